"""TGI-compatible HTTP API over the LightLLM-style engine (router/, modeling/, kernels/).

The wheel installs the engine packages under tgi_compat/_engine/ rather than as top-level
`router`, `modeling` and `kernels` (setup.py says why), so importing this package puts that folder
on sys.path. In a checkout they sit beside tgi_compat/; an editable install maps only tgi_compat,
so the checkout's root goes on sys.path when it is not there already.
"""

import os as _os
import sys as _sys


def _add_engine_root() -> None:
    here = _os.path.dirname(_os.path.abspath(__file__))
    installed = _os.path.join(here, "_engine")
    if _os.path.isdir(installed):
        if installed not in _sys.path:
            _sys.path.insert(0, installed)  # first: our `kernels` wins over any other installed one
        return
    checkout = _os.path.dirname(here)
    if _os.path.isdir(_os.path.join(checkout, "router")) and checkout not in map(_os.path.abspath, _sys.path):
        _sys.path.append(checkout)


_add_engine_root()
