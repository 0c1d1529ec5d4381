"""The page's own component: the trajectory, a gr.HTML whose template never changes and whose script
appends the rows a new value adds (or drops rows a shorter value no longer has: replay going back).

Its value is `{"run": id, "rows": [row html, ...]}` (`live.Trajectory.frame`), with `"rewind": true` to scroll back to
the first step and the rows' start. Rows are HTML rendered and
escaped on the server (`render.row_html`); the script only inserts them. Clicking a cell, or a bar of cells
(the committed prefix, a canvas's masked tail: `data-lo`, `data-n`), fires the component's `inspect` event
with `{pos}`.
"""
from __future__ import annotations

import gradio as gr

from studio.web import render

EMPTY = {"run": None, "rows": []}
_TEMPLATE = '<div class="traj"><div class="rows"><div class="steps"></div></div></div>'   # never changes

_SCRIPT = """
const scroller = element.querySelector('.rows');
const box = element.querySelector('.steps');   // as wide as its widest row, so row heads can stick
let run = null;
function draw() {
  const v = props.value || {};
  const rows = v.rows || [];
  if (v.run !== run) { box.replaceChildren(); run = v.run; }
  while (box.children.length > rows.length) box.lastElementChild.remove();
  const n = box.children.length;
  if (n < rows.length) {
    // follow the newest step (bottom) and the decoding frontier (its right end) unless the user scrolled away
    const follow = scroller.scrollTop + scroller.clientHeight >= scroller.scrollHeight - 24;
    box.insertAdjacentHTML('beforeend', rows.slice(n).join(''));
    if (follow) {
      // to the newest row's last cell, not its emitted text: in a narrow pane the text would scroll every
      // earlier row's cells out of sight
      scroller.scrollTop = scroller.scrollHeight;
      const cells = box.lastElementChild.querySelectorAll('.c, .cb');
      const last = cells[cells.length - 1];
      if (last) scroller.scrollLeft = Math.max(0, last.offsetLeft + last.offsetWidth + 8 - scroller.clientWidth);
    }
  }
  if (v.rewind) { scroller.scrollTop = 0; scroller.scrollLeft = 0; }
}
draw();
watch('value', draw);
box.addEventListener('click', (e) => {
  const cell = e.target.closest('[data-pos]');
  const bar = e.target.closest('.cb');
  if (cell) trigger('inspect', {pos: Number(cell.dataset.pos)});
  else if (bar) trigger('inspect', {pos: Number(bar.dataset.lo || 0)
                                         + Math.floor(e.offsetX / bar.offsetWidth * Number(bar.dataset.n))});
});
"""


def trajectory(elem_id: str) -> gr.HTML:
    return gr.HTML(value=EMPTY, html_template=_TEMPLATE,
                   js_on_load=_SCRIPT, elem_id=elem_id, apply_default_css=False)


def legend() -> gr.HTML:
    return gr.HTML(render.legend_html(), js_on_load=None)


def clicked_position(evt: gr.EventData) -> int | None:
    """The position an `inspect` event names."""
    pos = (evt._data or {}).get("pos")
    return int(pos) if isinstance(pos, (int, float)) else None


def download_row(prefix: str) -> tuple[gr.Dropdown, gr.Button, gr.File]:
    """Format, button and file of a tab's "download this run" row (the tab wires the button; its handler shows
    the file once there is one)."""
    from studio.web.files import DOWNLOADS
    with gr.Row():
        fmt = gr.Dropdown(list(DOWNLOADS), value="JSONL trace", label="Download as", elem_id=f"{prefix}-format")
        button = gr.Button("Prepare download", elem_id=f"{prefix}-download")
    # on a row of its own, full width: a long file name shows whole
    file = gr.File(label="File", interactive=False, visible=False, elem_id=f"{prefix}-file")
    return fmt, button, file
