"""The `--device` / `--dtype` / `--no-graphs` options of every generation command (the main CLI and `train` share them);
studio.engine.device resolves and checks the values."""
import typer

DEVICE = typer.Option("auto", "--device", help="auto (CUDA when available) | cpu | cuda.")
DTYPE = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on the CPU) | fp32 | bf16 | fp16.")
GRAPHS = typer.Option(True, "--graphs/--no-graphs", help="CUDA graphs for decode-sized forwards (on CUDA only; "
                      "--no-graphs runs every forward eagerly).")
