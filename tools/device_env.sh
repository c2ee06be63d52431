# Sourced by the device scripts (device_check, decode_check, ext_bench, prefill_ab, final_check, tune_check)
# after `cd` to the repository root: the environment of a run from the tree, the section test, the
# elapsed-time stamp and the deadline.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export QMOE_RTC_CACHE_DIR="${QMOE_RTC_CACHE_DIR:-/tmp/qmoe_rtc_cache}"
has() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
t0=$(date +%s)
stamp() { echo "== $1 (+$(( $(date +%s) - t0 )) s)"; }
# left TIMEOUT: a section's own limit, cut to what is left of DEADLINE seconds (default 590) for the call
left() { local r=$(( ${DEADLINE:-590} - ($(date +%s) - t0) )); [ "$r" -lt "$1" ] && echo $(( r > 5 ? r : 5 )) || echo "$1"; }
