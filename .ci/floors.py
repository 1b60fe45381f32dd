"""Print pip constraints pinning every `>=` floor of pyproject.toml's dependencies (TRL's tests_min_versions):
`python .ci/floors.py > floors.txt; pip install -c floors.txt -e .` installs the oldest set we declare."""
import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
for req in project["dependencies"]:
    if m := re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+).*", req):
        print(f"{m[1]}=={m[2]}")
    elif not re.fullmatch(r"[A-Za-z0-9_.-]+", req):
        sys.exit(f"{req}: a floor must be written 'name>=version' (or leave the package unbounded)")
