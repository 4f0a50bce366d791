"""A per-tensor FP8 scales file (`benchmarks.kv_peers`'s format) built from scales ``kv.json`` kept (issue 36).

Each per-tensor static row of ``kv.json`` keeps its ``k_scales`` / ``v_scales``. This writes a file
that ``python -m benchmarks.kv_peers --scales FILE --kv NAME`` evaluates in lowbit's FP8 cache:

* the keys' scales of one row and the values' of another (``--keys fp8-llmc --values fp8``: which side of
  llm-compressor's choice makes its difference);
* every scale times ``--factor`` (``1.00001``: no rule changes, only the elements next to an E4M3 rounding
  boundary move; the noise of one evaluation).

Rows are looked up on this machine's CPU, float weights, the model and calibration seed given (the scales depend
on the calibration only, not on the evaluation window)::

    python -m benchmarks.kv_scalefile --keys fp8 --values fp8 --factor 1.00001 --seed 0 --out noise.json
    python -m benchmarks.kv_peers --scales noise.json --kv fp8:noise --seqlen 8192 --windows 3 --nsamples 8 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.kv import RESULTS, cpu


def source_row(rows: list[dict[str, Any]], kv: str, seed: int, calib: str, model: str, here: str) -> dict[str, Any]:
    """The newest float-weights row of ``kv`` with scales kept, for this calibration and CPU."""
    found = [r for r in rows if r.get("kv") == kv and r.get("weights") == "float" and r.get("model") == model
             and r.get("calib_seed", 0) == seed and r.get("calib") == calib and cpu(r) == here and "k_scales" in r]
    if not found:
        raise SystemExit(f"error: kv.json has no float-weights row of {kv!r} with scales for calibration {calib} "
                         f"seed {seed} on this CPU ({here}); run it first (benchmarks.kv or benchmarks.kv_peers)")
    return found[-1]


def build(rows: list[dict[str, Any]], keys: str, values: str, factor: float, seed: int, calib: str, model: str,
          here: str) -> dict[str, Any]:
    """The scales file's content: attention name -> [k_scale, v_scale]."""
    k_row, v_row = (source_row(rows, kv, seed, calib, model, here) for kv in (keys, values))
    names = sorted(k_row["k_scales"])
    if sorted(v_row["v_scales"]) != names:
        raise SystemExit(f"error: the rows of {keys!r} and {values!r} hold different attentions")
    scales = {n: [k_row["k_scales"][n] * factor, v_row["v_scales"][n] * factor] for n in names}
    text = f"keys of {keys}, values of {values}" + (f", times {factor!r}" if factor != 1 else "")
    return {"calib": calib, "calib_seed": seed, "calibrate_s": None, "scales_from": f"kv.json rows: {text}",
            "scales": scales}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_scalefile", description=__doc__.split("\n")[0])
    p.add_argument("--keys", required=True, help="the kv.json row (its KV name) whose k_scales to take")
    p.add_argument("--values", required=True, help="the kv.json row whose v_scales to take")
    p.add_argument("--factor", type=float, default=1.0, help="multiply every scale by this")
    p.add_argument("--model", default="bundled", choices=common.MODELS)
    p.add_argument("--nsamples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="the rows' calibration seed")
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--out", required=True, help="the scales file to write")
    args = p.parse_args(argv)
    if not args.factor > 0:
        raise SystemExit("error: --factor must be positive")
    here = common.machine()["cpu"]
    data = build(common.load_results(args.results)["rows"], args.keys, args.values, args.factor, args.seed,
                 f"{args.nsamples}x{args.calib_seqlen}", args.model, here)
    from lowbit.io import atomic_write_text

    atomic_write_text(Path(args.out), json.dumps(data, indent=1))
    print(f"wrote {args.out}: {data['scales_from']}, {len(data['scales'])} attentions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
