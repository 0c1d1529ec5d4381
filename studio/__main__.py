try:
    from studio.cli import main
except KeyboardInterrupt:   # Ctrl+C while Python still reads the CLI's module, before the CLI's own guard is armed
    import os
    import sys
    sys.stderr.write("dlm-studio: interrupted\n")
    sys.stderr.flush()
    os._exit(130)

main()
