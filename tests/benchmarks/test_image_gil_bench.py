"""benchmarks/image_gil.py's smoke run: the image processor's host half beside a busy thread, at two switch
intervals, prints its table and leaves the process's interval as it found it."""

from __future__ import annotations

import sys

from benchmarks import image_gil


def test_the_gil_probe_runs_and_restores_the_interval(monkeypatch, capsys):
    before = sys.getswitchinterval()
    monkeypatch.setattr(sys, "argv", ["image_gil", "--images", "2", "--size", "112", "--intervals", "0.005,0.001"])
    image_gil.main()
    out = capsys.readouterr().out
    assert "| 5 ms |" in out and "| 1 ms |" in out and "ms an image alone" in out
    assert sys.getswitchinterval() == before
