"""Turn a pytest-benchmark JSON into the README's table: rate, bandwidth and side-by-side ratios.

python bench/table.py bench/cpu.json [bench/gpu.json]
"""

import json
import sys


def rows(path: str) -> list[str]:
    data = json.load(open(path))
    machine = data.get("machine_info", {})
    benches = data["benchmarks"]
    copy = next((b for b in benches if b["extra_info"].get("kind") == "copy"), None)
    naive = {b["extra_info"]["kind"]: b for b in benches if "naive" in b["name"]}
    out = [
        f"\nMachine: {machine.get('cpu', {}).get('brand_raw', machine.get('processor', '?'))}, "
        f"{machine.get('cpu', {}).get('count', '?')} CPUs; tensor {benches[0]['extra_info']['elements']:,} "
        f"elements ({benches[0]['extra_info']['device']}); median of rounds\n",
        "| op | implementation | ms | G elem/s | GB/s | vs naive torch | vs copy bandwidth |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in benches:
        info, t = b["extra_info"], b["stats"]["median"]
        impl = "naive torch" if "naive" in b["name"] else ("torch copy" if info["kind"] == "copy" else "espert")
        gbs = info["bytes"] / t / 1e9
        vs_naive = ""
        if impl == "espert" and info["kind"] in naive:
            vs_naive = f"{naive[info['kind']]['stats']['median'] / t:.1f}×"
        vs_copy = f"{(copy['stats']['median'] / t) * 100:.0f}%" if copy and impl != "torch copy" else ""
        out.append(
            f"| {info['kind']} | {impl} | {t * 1e3:.1f} | {info['elements'] / t / 1e9:.2f} | {gbs:.1f} | "
            f"{vs_naive} | {vs_copy} |"
        )
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print("\n".join(rows(p)))
