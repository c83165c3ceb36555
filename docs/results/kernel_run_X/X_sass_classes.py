"""Summarise `ncu --page source --csv --print-source sass` output (X4_sass.csv, X6_sass.csv,
not kept: 1.4 MB each): instructions grouped by how often each executed (one count per code
section: the per-query-block sections of the consumers, the producer's loop), with their share
of the executed instructions and of the stall samples, and the top stall reasons."""
import csv, io, sys
from collections import Counter, defaultdict
text = open(sys.argv[1]).read()
for pi, part in enumerate(text.split('"Kernel Name"')[1:]):
    rows = list(csv.reader(io.StringIO('\n'.join(part.split('\n')[1:]))))
    hdr = rows[0]; rows = [r for r in rows[1:] if len(r) == len(hdr)]
    ia, ie = hdr.index("Source"), hdr.index("Instructions Executed")
    iss = hdr.index("Warp Stall Sampling (All Samples)")
    stall_cols = [i for i, h in enumerate(hdr) if h.startswith('stall_') and 'Not Issued' not in h]
    tot = sum(float(r[iss] or 0) for r in rows); ex = sum(float(r[ie] or 0) for r in rows)
    groups = defaultdict(lambda: [0, 0.0, Counter(), Counter()])
    for r in rows:
        e = int(float(r[ie] or 0)); g = groups[e]
        g[0] += 1; g[1] += float(r[iss] or 0)
        toks = r[ia].split(); op = (toks[1] if toks[0].startswith('@') else toks[0]).split('.')[0]
        g[3][op] += 1
        for i in stall_cols: g[2][hdr[i]] += float(r[i] or 0)
    print(f"kernel {pi}: {ex:.0f} instructions executed, {tot:.0f} samples")
    for e, (n, sm, st, ops) in sorted(groups.items(), key=lambda x: -x[1][1])[:7]:
        print(f"  executed {e:7d}x: {n:4d} instructions, {e * n / ex * 100:5.1f}% of executed, "
              f"{sm / tot * 100:5.1f}% of samples; stalls {[(k[6:], round(v / max(sm, 1) * 100)) for k, v in st.most_common(4)]}; "
              f"ops {ops.most_common(8)}")
