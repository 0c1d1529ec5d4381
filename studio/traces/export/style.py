"""The stylesheet of the HTML report (`report`); the colours of the token states come from
`studio.viz.palette` and are added by the report."""

CSS = """
:root { --ink:#1f1f1f; --muted:#5f6368; --line:#e3e3e3; --bg:#fafafa; }
* { box-sizing: border-box; }
body { font-family: Inter, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif; color: var(--ink);
       background: var(--bg); margin: 0; line-height: 1.45; }
main { max-width: 1320px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 26px; margin: 0 0 4px; } h2 { font-size: 21px; margin: 34px 0 10px; border-bottom: 2px solid var(--line);
     padding-bottom: 6px; } h3 { font-size: 16px; margin: 22px 0 8px; color: #333; }
.sub { color: var(--muted); font-size: 14px; margin-bottom: 18px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 14px 18px; margin: 12px 0; }
.grid2 { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
@media (max-width: 900px) { .grid2 { grid-template-columns: 1fr; } }
table { border-collapse: collapse; font-size: 14px; width: 100%; }
th, td { text-align: left; padding: 5px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { color: var(--muted); font-weight: 600; white-space: nowrap; width: 1%; }
table.metrics td.num, table.cmp td.num { font-variant-numeric: tabular-nums; text-align: right; }
table.cmp th { width: auto; text-align: right; } table.cmp th:first-child { text-align: left; }
code, .mono { font-family: 'JetBrains Mono', 'DejaVu Sans Mono', Menlo, Consolas, monospace; font-size: 13px; }
.prompt { white-space: pre-wrap; }
.gen { font-family: 'JetBrains Mono', 'DejaVu Sans Mono', Menlo, Consolas, monospace; font-size: 15px;
       line-height: 2.0; white-space: pre-wrap; word-break: break-word; max-height: 30em; overflow-y: auto; }
.gen span { padding: 2px 1px; border-radius: 3px; text-underline-offset: 4px; text-decoration-thickness: 2px; }
.legend { display: flex; flex-wrap: wrap; gap: 6px 16px; font-size: 13px; margin: 4px 0 10px; color: #333; }
.legend .sw { display: inline-block; min-width: 22px; text-align: center; border-radius: 3px; margin-right: 5px;
              padding: 0 3px; border: 1px solid #888; font-weight: 700; }
.banner { background: #fff4e5; border: 1px solid #E69F00; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.notes li { margin: 3px 0; }
.chip { display: inline-block; background: #f1f3f4; border-radius: 10px; padding: 1px 8px; margin: 2px 4px 2px 0;
        font-size: 12.5px; }
.fig { background: #fff; border: 1px solid var(--line); border-radius: 8px; margin: 12px 0; padding: 8px;
       display: flex; flex-wrap: wrap; gap: 12px; }
.fig.wide { display: block; overflow-x: auto; }   /* the whole trajectory in the page: at most ~2400 px tall */
.chart { max-width: 100%; height: auto; } .fig.wide .chart { max-width: none; }
.chart text { fill: #222; }
footer { color: var(--muted); font-size: 12px; margin-top: 40px; }
"""
