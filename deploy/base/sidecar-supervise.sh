#!/bin/sh
# Keeps the flyserve sidecar process running inside its container, so that the container itself
# never exits: a restartable init container (native sidecar) that is not running is not Ready, and
# kubelet counts it in the pod's ContainersReady, so a sidecar that crash-loops at the kubelet level
# takes the pod, and vLLM's port, out of the Service (docs/deploy.md, "Why the sidecar is
# supervised", has the Kubernetes source). This loop restarts the process instead; the container
# stays Running, and so Ready (it has no readiness probe).
#
#   sh sidecar-supervise.sh COMMAND [ARG...]      (deploy/base/deployment.yaml runs it so)
#
# - COMMAND exits: it starts again after 1 s when it ran for at least $FLYSERVE_SUPERVISE_STABLE_S
#   (60), else after twice the previous delay, at most $FLYSERVE_SUPERVISE_MAX_DELAY_S (60).
# - Watchdog (replaces a kubelet liveness probe, whose restarts would also take the pod out of the
#   Service): when $FLYSERVE_SUPERVISE_HEALTHZ is a URL, it is asked every
#   $FLYSERVE_SUPERVISE_PERIOD_S (20) seconds, $FLYSERVE_SUPERVISE_GRACE_S (30) after each start,
#   with a 5 s timeout, by the image's python3; $FLYSERVE_SUPERVISE_MISSES (3) misses in a row send
#   COMMAND SIGTERM, then SIGKILL $FLYSERVE_SUPERVISE_KILL_AFTER_S (10) later, and it starts again.
# - SIGTERM or SIGINT (kubelet stopping the pod): passed to COMMAND, which is waited for; the script
#   exits with its status. No restart while stopping.
# - $FLYSERVE_SUPERVISE_PIDFILE (/tmp/flyserve-sidecar.pid) holds COMMAND's pid: `kill` it to restart
#   the sidecar alone (a new token, say) without touching vLLM.
# Every line it logs starts with "flyserve-supervise:" (on stderr, so `kubectl logs` shows it).
set -u

[ "$#" -gt 0 ] || { echo "flyserve-supervise: usage: sidecar-supervise.sh COMMAND [ARG...]" >&2; exit 2; }

stable_s=${FLYSERVE_SUPERVISE_STABLE_S:-60}
max_delay_s=${FLYSERVE_SUPERVISE_MAX_DELAY_S:-60}
healthz=${FLYSERVE_SUPERVISE_HEALTHZ:-}
period_s=${FLYSERVE_SUPERVISE_PERIOD_S:-20}
grace_s=${FLYSERVE_SUPERVISE_GRACE_S:-30}
misses_max=${FLYSERVE_SUPERVISE_MISSES:-3}
kill_after_s=${FLYSERVE_SUPERVISE_KILL_AFTER_S:-10}
pidfile=${FLYSERVE_SUPERVISE_PIDFILE:-/tmp/flyserve-sidecar.pid}

log() { echo "flyserve-supervise: $*" >&2; }

stopping=0
child=
watchdog=
on_stop() {
  stopping=1
  if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; fi
}
trap on_stop TERM INT

healthy() {
  python3 -c '
import sys, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(sys.argv[1], timeout=5) as r:
    sys.exit(0 if 200 <= r.status < 300 else 1)
' "$healthz" >/dev/null 2>&1
}

# $1: the pid to watch. Runs in the background; ends when that process is gone.
watch_health() {
  target=$1
  sleep "$grace_s"
  misses=0
  while kill -0 "$target" 2>/dev/null; do
    if healthy; then
      misses=0
    else
      misses=$((misses + 1))
      log "$healthz did not answer ($misses of $misses_max)"
    fi
    if [ "$misses" -ge "$misses_max" ]; then
      log "restarting pid $target: $healthz missed $misses times in a row"
      kill -TERM "$target" 2>/dev/null
      waited=0
      while kill -0 "$target" 2>/dev/null && [ "$waited" -lt "$kill_after_s" ]; do
        sleep 1
        waited=$((waited + 1))
      done
      kill -KILL "$target" 2>/dev/null
      return 0
    fi
    sleep "$period_s"
  done
}

if [ -n "$healthz" ] && ! command -v python3 >/dev/null 2>&1; then
  log "no python3 in this image: the $healthz watchdog is off"
  healthz=
fi

delay=1
restarts=0
while :; do
  started=$(date +%s)
  "$@" &
  child=$!
  echo "$child" > "$pidfile" 2>/dev/null || log "cannot write $pidfile"
  watchdog=
  if [ -n "$healthz" ]; then
    watch_health "$child" &
    watchdog=$!
  fi
  # wait returns early when a trapped signal arrives: wait again until the process is gone
  while :; do
    wait "$child"
    rc=$?
    kill -0 "$child" 2>/dev/null || break
  done
  child=
  if [ -n "$watchdog" ]; then
    kill "$watchdog" 2>/dev/null
    wait "$watchdog" 2>/dev/null
  fi
  ran=$(( $(date +%s) - started ))
  if [ "$stopping" = 1 ]; then
    log "stopped (exit status $rc after ${ran}s)"
    exit "$rc"
  fi
  if [ "$ran" -ge "$stable_s" ]; then
    delay=1
  fi
  restarts=$((restarts + 1))
  log "exited with status $rc after ${ran}s; restart $restarts in ${delay}s"
  sleep "$delay" &
  wait $! 2>/dev/null
  if [ "$stopping" = 1 ]; then
    log "stopped while waiting to restart"
    exit "$rc"
  fi
  delay=$((delay * 2))
  if [ "$delay" -gt "$max_delay_s" ]; then delay=$max_delay_s; fi
done
