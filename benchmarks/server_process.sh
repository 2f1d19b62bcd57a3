# Sourced by the benchmark scripts that start servers: $SERVER is the process group of the server
# running now (started with setsid), and stop_server ends it (SIGTERM, then SIGKILL after 30 s).
# A script sets `trap stop_server EXIT` so that a server never outlives it.
SERVER=""
stop_server() {
  [ -n "$SERVER" ] || return 0
  kill -TERM -- "-$SERVER" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 -- "-$SERVER" 2>/dev/null || { SERVER=""; return 0; }; sleep 1; done
  kill -KILL -- "-$SERVER" 2>/dev/null || true
  SERVER=""
}
