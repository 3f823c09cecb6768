"""benchmarks/image_burst.py's smoke run: a burst of images through the API's own fetcher at two caps on the images
its threads decode at once and in worker processes, each image back (decoded and resized) and the table printed."""

from __future__ import annotations

import sys

from benchmarks import image_burst


def test_the_burst_probe_runs_every_cap_and_the_processes(monkeypatch, capsys):
    argv = ["image_burst", "--images", "3", "--size", "112", "--caps", "3,1", "--processes", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    image_burst.main()
    out = capsys.readouterr().out
    assert "| threads, 3 at once |" in out and "| threads, 1 at once |" in out and "| 2 processes |" in out
    assert "3 noise PNGs of 112px" in out
