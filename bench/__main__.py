"""``python -m bench``: the same as ``python bench/run.py`` (same options).

``python -m bench --gpu [options]`` runs ``bench/gpu.py`` instead (the GPU checks; see
``python -m bench --gpu --help``), before run.py's imports: it needs no matplotlib.
"""

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the scripts import each other by name, as when run as files
if "--gpu" in sys.argv[1:]:
    sys.argv.remove("--gpu")
    runpy.run_path(str(HERE / "gpu.py"), run_name="__main__")
else:
    runpy.run_path(str(HERE / "run.py"), run_name="__main__")
