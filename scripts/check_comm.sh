#!/usr/bin/env bash
# The communication gate over the examples' committed baselines: fails (exit 1) when a change
# makes a step of any example move more bytes than its baseline in baselines/, or fewer.
# See what a rewrite would change with `autopar check ... --update`; rewrite with `--update --accept`.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
status=0
while read -r name mesh strategy; do
  echo "== $name ($mesh, $strategy)"
  autopar check examples/gpt.py --mesh "$mesh" --strategy "$strategy" --baseline "baselines/$name.json" || status=1
done <<'CASES'
example_gpt_dp2 dp=2 dp
example_gpt_tp2 tp=2 tp
example_gpt_tp2_sp tp=2 sp
example_gpt_dp2_tp2_sp dp=2,tp=2 dp,sp
example_gpt_pp2_dp2 pp=2,dp=2 pp,dp
example_gpt_dp2_cp2 dp=2,cp=2 dp,cp
CASES
exit $status
