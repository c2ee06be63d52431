# Sourced by tools/device_check.sh (and any device script of a session) after `cd` to the repository
# root: the environment of a run from the tree, the section test, the elapsed-time stamp, the deadline
# and the parallel precompile.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export QMOE_RTC_CACHE_DIR="${QMOE_RTC_CACHE_DIR:-/tmp/qmoe_rtc_cache}"
has() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
t0=$(date +%s)
stamp() { echo "== $1 (+$(( $(date +%s) - t0 )) s)"; }
# left TIMEOUT: a section's own limit, cut to what is left of DEADLINE seconds (default 590) for the call
left() { local r=$(( ${DEADLINE:-590} - ($(date +%s) - t0) )); [ "$r" -lt "$1" ] && echo $(( r > 5 ? r : 5 )) || echo "$1"; }
# precompile LIMIT: every module the GPU tests load, compiled in parallel; a limit that cuts it is said
# (the tests then compile the rest one module at a time: minutes of device time)
precompile() {
  stamp precompile
  timeout "$1" python3 tools/precompile.py --arch sm_90 --jobs 16 2>&1 | tail -3
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then echo "WARNING: precompile cut at $1 s: the GPU tests compile the rest one module at a time"
  elif [ "$rc" != 0 ]; then echo "WARNING: precompile exited $rc"; fi
  return 0
}
