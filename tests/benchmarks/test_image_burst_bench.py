"""benchmarks/image_burst.py's smoke run: a burst of images through the API's own fetcher at two caps on the images
read at once, each image back (decoded and resized) and the table printed."""

from __future__ import annotations

import sys

from benchmarks import image_burst


def test_the_burst_probe_runs_every_cap(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["image_burst", "--images", "3", "--size", "112", "--caps", "3,1"])
    image_burst.main()
    out = capsys.readouterr().out
    assert "| 3 |" in out and "| 1 |" in out and "3 noise PNGs of 112px" in out
