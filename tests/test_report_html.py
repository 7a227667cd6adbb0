"""report.html (kimi_compile/report.py): self-contained, every image a PNG that decodes, every number of the
manifest's summary on the page."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser

import pytest

from kimi_compile.artifact import load_manifest
from kimi_compile.report import render_html, summary


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a.get("src", ""))
        if tag in ("link", "script") or (tag == "a" and not a.get("href", "#").startswith("#")):
            self.links.append((tag, a))

    def handle_data(self, data):
        self.text.append(data)


def _check_page(html: str, manifest: dict, min_images: int) -> str:
    from PIL import Image

    page = _Page()
    page.feed(html)
    assert not page.links, page.links  # nothing external: no stylesheet, script or outside link
    assert len(page.images) >= min_images
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        img = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        img.verify()
        assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 100
    text = " ".join(page.text)
    for label, value in manifest["summary"].items():
        assert label in text
        for number in re.findall(r"\d+(?:\.\d+)?", value):
            assert number in text, (label, number)
    return text


@pytest.mark.parametrize("which", ["tiny_build", "quant_build"])
def test_built_report_html(which, request):
    res = request.getfixturevalue(which)[1]
    m = load_manifest(res.artifact)
    assert "report.html" in m["files"] and m["summary"] == summary({k: v for k, v in m.items()
                                                                   if k not in ("files", "schema_version")})
    text = _check_page((res.artifact / "report.html").read_text(), m, 5 if which == "quant_build" else 4)
    for title in ("Build stages", "Passes", "Cache layouts", "Op coverage: prefill", "Op coverage: decode"):
        assert title in text
    if which == "quant_build":
        assert "Accuracy (quantized vs unquantized)" in text and "greedy agreement" in text


def test_html_tolerates_sparse_manifests():
    html = render_html({})
    assert "<h1>kimi-compile artifact: artifact</h1>" in html and "<img" not in html
    odd = {"stages": [{"stage": "trace", "seconds": "x"}], "pass_log": ["weird"], "op_coverage": {"prefill": 3},
           "cache_layouts": [{"name": "kv.3", "bytes_per_token": 20, "kind": "kv", "dtype": "float32"}],
           "recipe": {"name": "<b>&"}}
    html = render_html(odd)
    assert "&lt;b&gt;&amp;" in html and html.count("<img") == 1  # the cache plot only


def test_context_parallel_balance_table_and_plot():
    """A cp artifact's manifest carries the prefill balance of its model (build._parallel, cp_layout.balance_table);
    the report shows it as a table and a plot, at kimi-k3.1-pro's size here: zigzag max/mean near 1.0, contiguous
    toward (2P-1)/P."""
    from kimi_compile.config import preset
    from kimi_compile.cp_layout import balance_table
    from kimi_compile.report import render_report, summary

    rows = balance_table(preset("kimi-k3.1-pro"))
    manifest = {"recipe": {"name": "k31-pro-cp"}, "parallel": {"cp": 4, "cp_balance": {"model": "test", "rows": rows}}}
    manifest["summary"] = summary(manifest)
    text = _check_page(render_html(manifest), manifest, 1)
    assert "Context-parallel balance" in text
    md = render_report(manifest)
    line = next(ln for ln in md.splitlines() if ln.startswith("| 1M | 8 | contiguous |"))
    assert 1.8 < float(line.split("|")[4]) < 1.875  # (2P-1)/P = 1.875 at P = 8
    zig = [r["max_over_mean"] for r in rows if r["layout"] == "zigzag"]
    assert max(zig) < 1.03 and f"{zig[0]:.4f}" in md
