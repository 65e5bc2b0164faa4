# From the repository root after `bash scripts/setup.sh`; no venv to activate, no GPU. Paste it line by
# line, or run `bash -e examples/tour.sh` (tests/integration/test_readme_tour.py does, in CI).
fs=.venv/bin/flyserve                         # (or plain `flyserve` where it is on your PATH)
work=$(mktemp -d) && port=${TOUR_PORT:-9400}   # scratch files, and the sidecar's port
$fs check-config examples/my-thresholds.yaml   # validate a thresholds file, print the effective values
$fs init --state-dir $work/fs                  # a state directory (a server also creates its own)
$fs simulate --state-dir $work/fs --ranks 4 --workload seed-32k-c32 --steps 2000 --quiet > $work/simulate.log &
python3 -c 'import secrets; print(secrets.token_hex(24))' > $work/token.txt && chmod 600 $work/token.txt
$fs sidecar --state-dir $work/fs --token-file $work/token.txt --port $port 2> $work/sidecar.log &
for i in $(seq 90); do curl -sf localhost:$port/readyz && echo && break || sleep 1; done   # ready: ranks report
curl -s localhost:$port/dispatch-stats | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["live_ranks"], "live ranks", d["totals"]["decisions"])'
$fs thresholds set --state-dir $work/fs min_seq_len=4096   # every rank switches at the same engine step
curl -s -X PATCH localhost:$port/thresholds -H "Authorization: Bearer $(cat $work/token.txt)" -H 'content-type: application/json' -d '{"lpt": "never"}' -o /dev/null -w 'PATCH /thresholds: %{http_code}\n'
$fs thresholds history --state-dir $work/fs     # versions; `thresholds rollback --state-dir $work/fs 1` goes back
$fs replay --workload all -p gfx950 -p h200 -p examples/my-thresholds.yaml --costs h200   # thresholds vs the oracle
$fs dashboards build --out $work/dashboards     # the Grafana JSON (the committed copies: dashboards/)
kill %1 %2                                      # stop the simulator and the sidecar
