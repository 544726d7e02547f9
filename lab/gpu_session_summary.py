"""Print the stages and evaluate metrics of the CUDA recipes' reports under OUT/build (lab/gpu_session.sh)."""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
for rep_file in sorted((out / "build").glob("*/report.json")):
    rep = json.loads(rep_file.read_text())
    print(rep_file.parent.name, rep.get("status"), rep.get("wall_s"))
    for s in rep["stages"]:
        print(f"  {s['name']:<10} {s['status']:<8} {s.get('duration_s')}  {(s.get('message') or '')[:240]}")
        m = s.get("metrics") or {}
        keep = {k: v for k, v in m.items() if isinstance(v, (int, float, str)) and len(str(v)) < 80}
        if keep and s["name"] in ("evaluate", "validate", "build"):
            print("     ", json.dumps(keep)[:900])
