#!/usr/bin/env bash
# CI stage: pdserve in containers, for real.
#
#   engine  install Docker's engine and Compose from Debian's packages if absent; start dockerd
#   base    the base image (pdserve-base:bookworm via debootstrap, unless BASE_IMAGE is given)
#   wheels  deploy/wheels for the image's pip --no-index install
#   images  pdserve and the Prometheus stand-in
#   up      docker-compose up -d, wait for every health check
#   query   gRPC requests from this host through the published router port; replies checked
#   scale   --scale decode=2; both replicas must serve requests
#   metrics pdserve_handoff_seconds from each service's /metrics and from Prometheus' HTTP API
#   model   the stack again with the default model (SmolLM2, converted in the image): one chat
#           question, the reply must name Tokyo; no container may convert the model itself
#   down    down -v; nothing of the stack left; dockerd stopped if this script started it
#
# Every wait is bounded; any failure exits non-zero (after dumping the services' logs).
# Settings: BASE_IMAGE, PROMETHEUS_IMAGE (upstream images where they can be pulled), COMPOSE
# ("docker compose" for v2), PDSERVE_CI_METRICS (auto|require|skip), PDSERVE_CI_KEEP_DOCKERD=1
# (leave a dockerd this script started running; its pid is printed for the caller to stop).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

export BASE_IMAGE=${BASE_IMAGE:-pdserve-base:bookworm}
export PDSERVE_IMAGE=${PDSERVE_IMAGE:-pdserve:local}
# The stack serves TinyGPT whatever the caller's environment says: small and fast, and the checks
# of up to metrics expect its byte tokenizer (prompt_tokens per byte of prompt). Phase model then
# runs the default model.
export PDSERVE_MODEL=tinygpt
LOCAL_PROMETHEUS=pdserve-prometheus:local
export PROMETHEUS_IMAGE=${PROMETHEUS_IMAGE:-$LOCAL_PROMETHEUS}
PROJECT=${PDSERVE_CI_PROJECT:-pdserveci}
METRICS_MODE=${PDSERVE_CI_METRICS:-auto}
PY=$ROOT/.venv/bin/python
LOGS=$(mktemp -d /tmp/pdserve-compose-ci.XXXXXX)

T0=$(date +%s)
PHASE=setup
PHASE_START=$T0
TIMES=()
phase() {  # ends the current phase, starts the next
  local now; now=$(date +%s)
  TIMES+=("$(printf '%-8s %4ds' "$PHASE" $((now - PHASE_START)))")
  echo "== [$PHASE done in $((now - PHASE_START))s] ${1:+-> $1}"
  PHASE=${1:-}
  PHASE_START=$now
}
fail() { echo "compose_ci: FAIL ($PHASE): $*" >&2; exit 1; }
# Runs "$@" with a deadline, its output to $LOGS/$name.log, shown only on failure.
quiet() {
  local name=$1 limit=$2; shift 2
  if ! timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1; then
    tail -40 "$LOGS/$name.log" >&2
    fail "$name failed or took over ${limit}s"
  fi
}

# ------------------------------------------------------------------ engine
STARTED_DOCKERD=
DOCKERD_PID=
STACK_UP=
cleanup() {
  local rc=$?
  set +e
  if [[ -n "$STACK_UP" ]]; then
    if [[ $rc -ne 0 ]]; then
      echo "---- service logs (last 60 lines each) ----" >&2
      timeout 60 "${COMPOSE[@]}" logs --no-color --tail=60 >&2
    fi
    timeout 120 "${COMPOSE[@]}" down -v --remove-orphans --timeout 10 >"$LOGS/down.log" 2>&1 \
      || { cat "$LOGS/down.log" >&2; rc=1; }
  fi
  if [[ -n "$STARTED_DOCKERD" && -n "${PDSERVE_CI_KEEP_DOCKERD:-}" ]]; then
    echo "compose_ci: left running: dockerd pid $DOCKERD_PID"  # the caller stops it
  elif [[ -n "$STARTED_DOCKERD" ]]; then
    kill "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && { echo "dockerd did not stop" >&2; kill -9 "$DOCKERD_PID"; }
  fi
  rm -rf "$LOGS"
  exit $rc
}
trap cleanup EXIT
trap 'exit 143' TERM INT  # so that a caller's SIGTERM still takes the stack down

need_apt=()
command -v dockerd >/dev/null || need_apt+=(docker.io)
if [[ -z "${COMPOSE:-}" ]] && ! command -v docker-compose >/dev/null \
   && ! docker compose version >/dev/null 2>&1; then
  need_apt+=(docker-compose)
fi
if (( ${#need_apt[@]} )); then
  echo "installing ${need_apt[*]} from Debian's packages"
  quiet apt-update 300 apt-get update
  quiet apt-install 600 env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends "${need_apt[@]}"
fi
command -v debootstrap >/dev/null || [[ "$BASE_IMAGE" != pdserve-base:* ]] \
  || quiet apt-debootstrap 300 env DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap

if ! timeout 20 docker info >/dev/null 2>&1; then
  echo "starting dockerd (log: /tmp/pdserve-dockerd.log)"
  # Its own session: a signal meant for this script's process group does not reach it.
  setsid dockerd >/tmp/pdserve-dockerd.log 2>&1 </dev/null &
  DOCKERD_PID=$!
  STARTED_DOCKERD=1
  for _ in $(seq 60); do timeout 5 docker info >/dev/null 2>&1 && break; sleep 1; done
  timeout 10 docker info >/dev/null 2>&1 || { tail -20 /tmp/pdserve-dockerd.log >&2; fail "dockerd did not start"; }
fi
if [[ -n "${COMPOSE:-}" ]]; then
  read -r -a COMPOSE_BIN <<<"$COMPOSE"
elif command -v docker-compose >/dev/null; then
  COMPOSE_BIN=(docker-compose)
else
  COMPOSE_BIN=(docker compose)
fi
COMPOSE=("${COMPOSE_BIN[@]}" -p "$PROJECT" -f "$ROOT/docker-compose.yml")
echo "engine: $(docker version --format 'server {{.Server.Version}}, client {{.Client.Version}}')," \
     "compose: $("${COMPOSE_BIN[@]}" version --short 2>/dev/null || "${COMPOSE_BIN[@]}" version | head -1)"
[[ -x "$PY" ]] || quiet install 900 bash scripts/install.sh

# Host ports: free ones, so a service already on this machine cannot collide with the stack.
read -r ROUTER_PORT ROUTER_METRICS_PORT PROM_PORT ROUTER_HTTP_PORT < <("$PY" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
EOF
)
export PDSERVE_ROUTER_PORT=$ROUTER_PORT PDSERVE_ROUTER_METRICS_PORT=$ROUTER_METRICS_PORT
export PDSERVE_ROUTER_HTTP_PORT=$ROUTER_HTTP_PORT
export PROMETHEUS_PORT=$PROM_PORT PDSERVE_PUBLISH_ADDR=127.0.0.1
# Placement as a small host would use it: decode alone on the last CPU, the rest elsewhere.
LAST_CPU=$(( $(nproc) - 1 ))
if (( LAST_CPU > 0 )); then
  OTHERS=0; (( LAST_CPU > 1 )) && OTHERS=0-$(( LAST_CPU - 1 ))
  export PDSERVE_DECODE_CPUSET=$LAST_CPU PDSERVE_PREFILL_CPUSET=$OTHERS PDSERVE_ROUTER_CPUSET=$OTHERS
fi
# Anything left by an earlier, interrupted run goes first.
timeout 120 "${COMPOSE[@]}" down -v --remove-orphans --timeout 5 >/dev/null 2>&1 || true
phase base

# ------------------------------------------------------------------ base, wheels, images
if [[ "$BASE_IMAGE" == pdserve-base:* ]]; then
  quiet base 600 env BASE_IMAGE_TAG="$BASE_IMAGE" bash scripts/build_base_image.sh
fi
tail -1 "$LOGS/base.log" 2>/dev/null || true
phase wheels
quiet wheels 600 env PYTHON="$PY" bash scripts/prepare_wheels.sh
tail -1 "$LOGS/wheels.log"
phase images
quiet build-pdserve 900 docker build -f deploy/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --label io.pdserve.image=pdserve -t "$PDSERVE_IMAGE" .
if [[ "$PROMETHEUS_IMAGE" == "$LOCAL_PROMETHEUS" ]]; then
  quiet build-prometheus 600 docker build --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --label io.pdserve.image=prometheus -t "$PROMETHEUS_IMAGE" deploy/prometheus
fi
# Superseded builds of these images (untagged, labelled by us) only take disk.
docker image prune -f --filter label=io.pdserve.image >/dev/null 2>&1 || true
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' "$PDSERVE_IMAGE"
[[ "$(docker run --rm --entrypoint id "$PDSERVE_IMAGE" -u)" != 0 ]] || fail "the image runs as root"
phase up

# ------------------------------------------------------------------ up
# Mutual TLS between the containers, as the compose file has it by default: fresh development
# certificates for this run (keys readable: the containers run as another user than root).
export PDSERVE_CERTS_DIR="$LOGS/certs"
"$ROOT/.venv/bin/pdserve" certs "$PDSERVE_CERTS_DIR" --readable-keys >/dev/null
chmod 755 "$LOGS"
# The host-side clients below reach the router over TLS with the same CA.
export PDSERVE_TLS_CA="$PDSERVE_CERTS_DIR/ca.pem"
STACK_UP=1
# up -d returns once prefill and decode are healthy (the router depends on that) or fails.
quiet up 400 "${COMPOSE[@]}" up -d --no-build
wait_healthy() {  # $1: seconds; every container of the project healthy (or running, if no check)
  local deadline=$(( $(date +%s) + $1 )) ids states
  while :; do
    ids=$("${COMPOSE[@]}" ps -q)
    states=$(docker inspect --format '{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' $ids 2>&1)
    if [[ -n "$ids" ]] && ! grep -qvE ' (healthy|running)$' <<<"$states"; then
      echo "$states"; return 0
    fi
    if grep -qE ' (unhealthy|exited|dead)$' <<<"$states"; then echo "$states" >&2; return 1; fi
    (( $(date +%s) < deadline )) || { echo "$states" >&2; return 1; }
    sleep 2
  done
}
wait_healthy 180 || fail "services not healthy in time"
# Least privilege, as the compose file asks: read-only root, no capabilities, no privilege gain.
for svc in router prefill decode; do
  hard=$(docker inspect --format '{{.HostConfig.ReadonlyRootfs}} {{.HostConfig.CapDrop}} {{.HostConfig.SecurityOpt}}' "$("${COMPOSE[@]}" ps -q "$svc")")
  [[ "$hard" == "true [ALL] [no-new-privileges:true]" ]] || fail "$svc is not locked down: $hard"
done
echo "  hardening: read-only root, cap_drop ALL, no-new-privileges on router, prefill, decode"
if [[ -n "${PDSERVE_DECODE_CPUSET:-}" ]]; then
  # The cpuset reached the container, and decode's threads followed it.
  cpuset=$(docker inspect --format '{{.HostConfig.CpusetCpus}}' "$("${COMPOSE[@]}" ps -q decode)")
  [[ "$cpuset" == "$PDSERVE_DECODE_CPUSET" ]] || fail "decode cpuset is '$cpuset', want $PDSERVE_DECODE_CPUSET"
  "${COMPOSE[@]}" logs --no-color decode >"$LOGS/placement.log" 2>&1
  grep -q "torch threads: 1 for the engine, on CPUs \[$PDSERVE_DECODE_CPUSET\]" "$LOGS/placement.log" \
    || { tail -20 "$LOGS/placement.log" >&2; fail "decode's torch threads did not follow its cpuset"; }
  echo "  placement: decode on CPU $PDSERVE_DECODE_CPUSET with 1 torch thread, prefill on $PDSERVE_PREFILL_CPUSET"
fi
phase query

# ------------------------------------------------------------------ query
# Sends prompts to the router and checks every reply; prints one JSON line per request.
client() {  # $1: requests, $2: max tokens per request
  timeout 300 "$PY" - "127.0.0.1:$ROUTER_PORT" "$1" "$2" <<'EOF'
import json, sys
import grpc
from pdserve.v1 import pdserve_pb2 as pb, pdserve_pb2_grpc as pb_grpc

address, count, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompts = ["The quick brown fox", "Disaggregated prefill and decode " * 4, "hello"]
from pdserve.rpc.tls import client_channel  # TLS with PDSERVE_TLS_CA, as the router serves

with client_channel(address) as channel:
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = pb_grpc.RouterServiceStub(channel)
    for i in range(count):
        prompt = prompts[i % len(prompts)]
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        tokens, text, last = [], "", None
        for response in stub.Generate(request, timeout=60):
            tokens += response.token_ids
            text += response.text
            last = response
        problems = []
        if last is None or last.finish_reason != pb.FINISH_REASON_LENGTH:
            problems.append(f"finish_reason {last and last.finish_reason}, want LENGTH")
        if len(tokens) != max_tokens or last.usage.completion_tokens != max_tokens:
            problems.append(f"{len(tokens)} tokens streamed, usage says "
                            f"{last.usage.completion_tokens}, want {max_tokens}")
        if last.usage.prompt_tokens < len(prompt.encode()) // 2:
            problems.append(f"prompt_tokens {last.usage.prompt_tokens} for {len(prompt)} chars")
        m = last.metrics
        if not m.decode_instance or not m.prefill_instance or m.handoff.bytes <= 0:
            problems.append(f"metrics incomplete: {m}")
        if m.handoff.transport != "tcp":  # decode's data plane, container to container
            problems.append(f"KV went over {m.handoff.transport!r}, not the TCP data plane")
        print(json.dumps({"prompt": prompt, "tokens": len(tokens), "text": text,
                          "prompt_tokens": last.usage.prompt_tokens,
                          "decode": m.decode_instance, "prefill": m.prefill_instance,
                          "handoff_bytes": m.handoff.bytes,
                          "handoff_ms": round(m.handoff.seconds * 1e3, 3),
                          "transport": m.handoff.transport,
                          "ttft_ms": round(m.time_to_first_token_seconds * 1e3, 1),
                          "problems": problems}))
        sys.stdout.flush()
        if problems:
            sys.exit(f"request {i}: " + "; ".join(problems))
EOF
}
client 6 16 >"$LOGS/query.jsonl" || { cat "$LOGS/query.jsonl" >&2; fail "requests failed"; }
"$PY" - "$LOGS/query.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    print(f"  {r['prompt_tokens']:3d} prompt + {r['tokens']} tokens, handoff "
          f"{r['handoff_bytes'] / 1024:.0f} KiB in {r['handoff_ms']} ms over {r['transport']}, TTFT {r['ttft_ms']} ms, "
          f"{r['prefill']} -> {r['decode']}")
EOF
# Smoke check of the CLI a user would run, through the same published port.
timeout 60 "$ROOT/.venv/bin/pdserve" generate "hello from the host" --max-tokens 8 \
  --address "127.0.0.1:$ROUTER_PORT" >"$LOGS/generate.out" 2>"$LOGS/generate.err" \
  || { cat "$LOGS/generate.err" >&2; fail "pdserve generate failed"; }
grep -q "8 generated tokens" "$LOGS/generate.err" || { cat "$LOGS/generate.err" >&2; fail "pdserve generate: wrong token count"; }
phase scale

# ------------------------------------------------------------------ scale
quiet scale 300 "${COMPOSE[@]}" up -d --no-build --scale decode=2
wait_healthy 180 || fail "scaled services not healthy in time"
[[ $("${COMPOSE[@]}" ps -q decode | wc -l) -eq 2 ]] || fail "expected 2 decode containers"
# The router re-resolves `decode` every second and health-checks what it finds: within a few
# seconds both replicas get work. Keep sending (bounded) until both have answered.
seen=""
for _ in $(seq 15); do
  client 4 8 >>"$LOGS/scale.jsonl" || { cat "$LOGS/scale.jsonl" >&2; fail "requests failed after scaling"; }
  seen=$("$PY" -c 'import json,sys; print(len({json.loads(l)["decode"] for l in open(sys.argv[1])}))' \
    "$LOGS/scale.jsonl")
  [[ "$seen" -ge 2 ]] && break
  sleep 2
done
"$PY" - "$LOGS/scale.jsonl" <<'EOF'
import collections, json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for name, n in sorted(collections.Counter(r["decode"] for r in rows).items()):
    print(f"  {name}: {n} request(s)")
by_prompt = collections.defaultdict(set)
for r in rows:
    by_prompt[r["prompt"]].add(r["text"])
diverged = [p for p, texts in by_prompt.items() if len(texts) > 1]
if diverged:
    sys.exit(f"greedy replies differ between replicas for {diverged}")
EOF
[[ "$seen" -ge 2 ]] || fail "only $seen decode instance(s) received work after scaling to 2"
# Each replica's own log shows the requests it committed.
for id in $("${COMPOSE[@]}" ps -q decode); do
  docker logs "$id" >"$LOGS/decode-$id.log" 2>&1
  echo "  decode container ${id:0:12}: $(wc -l <"$LOGS/decode-$id.log") log lines"
done
phase metrics

# ------------------------------------------------------------------ metrics
if [[ "$METRICS_MODE" == auto ]]; then
  # Required once the services wire their metrics endpoint up.
  if grep -rqsE "metrics\.start\(|start_http_server\(" services pdserve/cli.py pdserve/rpc; then
    METRICS_MODE=require
  else
    METRICS_MODE=skip
  fi
fi
if [[ "$METRICS_MODE" == skip ]]; then
  echo "  SKIP: the services do not serve /metrics yet (PDSERVE_CI_METRICS=require forces it)"
else
  targets=("router=127.0.0.1:$ROUTER_METRICS_PORT")
  for service in prefill decode; do
    port=$([[ $service == prefill ]] && echo 9101 || echo 9102)
    n=$("${COMPOSE[@]}" ps -q "$service" | wc -l)
    for index in $(seq "$n"); do
      published=$("${COMPOSE[@]}" port --index="$index" "$service" "$port" | tail -1)
      [[ -n "$published" ]] || fail "$service #$index: metrics port $port not published"
      targets+=("$service#$index=$published")
    done
  done
  timeout 200 "$PY" - "127.0.0.1:$PROM_PORT" "${targets[@]}" <<'EOF' || fail "metrics check failed"
import json, re, sys, time, urllib.parse, urllib.request

def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()

def handoff(text):
    """(count, sum) of pdserve_handoff_seconds over its label sets."""
    count = sum(float(v) for v in re.findall(r"^pdserve_handoff_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M))
    total = sum(float(v) for v in re.findall(r"^pdserve_handoff_seconds_sum(?:\{[^}]*\})? (\S+)$", text, re.M))
    return count, total

prom, targets = sys.argv[1], dict(t.split("=", 1) for t in sys.argv[2:])
bad = []
for name, address in targets.items():
    try:
        count, total = handoff(get(f"http://{address}/metrics"))
    except OSError as exc:
        bad.append(f"{name}: /metrics on {address}: {exc}")
        continue
    mean = f"{total / count * 1e3:.2f} ms mean" if count else "-"
    print(f"  {name:10s} {address:21s} pdserve_handoff_seconds_count {count:.0f}, {mean}")
    if count <= 0:
        bad.append(f"{name}: pdserve_handoff_seconds_count is {count}")

# Prometheus scrapes every 2 s and re-resolves DNS every 5 s: wait (bounded) for every replica.
want = {"router": 1, "prefill": sum(k.startswith("prefill") for k in targets),
        "decode": sum(k.startswith("decode") for k in targets)}
query = urllib.parse.quote("pdserve_handoff_seconds_sum / pdserve_handoff_seconds_count")
deadline, got = time.time() + 90, {}
while time.time() < deadline:
    try:
        reply = json.loads(get(f"http://{prom}/api/v1/query?query={query}"))
        results = reply["data"]["result"]
    except (OSError, ValueError, KeyError):
        results = []
    got = {}
    for r in results:
        got.setdefault(r["metric"].get("job", "?"), []).append(
            (r["metric"].get("instance"), float(r["value"][1])))
    if all(len(got.get(job, [])) >= n for job, n in want.items()):
        break
    time.sleep(2)
for job in sorted(got):
    for instance, mean in sorted(got[job]):
        print(f"  prometheus job={job:8s} instance={instance:20s} mean handoff {mean * 1e3:.2f} ms")
for job, n in want.items():
    if len(got.get(job, [])) < n:
        bad.append(f"prometheus: {len(got.get(job, []))} {job} target(s) with handoffs, want {n}")
if bad:
    sys.exit("\n".join(bad))
EOF
fi
phase model

# ------------------------------------------------------------------ model
# PDSERVE_MODEL empty: every service serves its default, smollm2-135m-instruct, from the
# conversion the image holds. Compose recreates router, prefill and decode (back to one replica).
quiet model-up 300 env PDSERVE_MODEL= "${COMPOSE[@]}" up -d --no-build --scale decode=1
wait_healthy 180 || fail "services not healthy in time with the default model"
timeout 60 "$ROOT/.venv/bin/pdserve" generate --chat "What is the capital of Japan?" \
  --address "127.0.0.1:$ROUTER_PORT" >"$LOGS/chat.out" 2>"$LOGS/chat.err" \
  || { cat "$LOGS/chat.out" "$LOGS/chat.err" >&2; fail "pdserve generate --chat failed"; }
echo "  $(cat "$LOGS/chat.out")"
echo "  $(tail -1 "$LOGS/chat.err")"
grep -q "Tokyo" "$LOGS/chat.out" || fail "the default model's reply does not name Tokyo"
# (The image build already fails if the default model would be converted again; this is the
# containers' side of it: gguf_import logs every conversion.)
"${COMPOSE[@]}" logs --no-color router prefill decode >"$LOGS/model.log" 2>&1
! grep -E "converted .*\.gguf to " "$LOGS/model.log" \
  || fail "a container converted the model; the image should hold the conversion"
phase down

# ------------------------------------------------------------------ down
STACK_UP=
quiet down 120 "${COMPOSE[@]}" down -v --remove-orphans --timeout 10
left=$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")
[[ -z "$left" ]] || fail "containers left after down: $left"
[[ -z "$(docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT")" ]] \
  || fail "volumes left after down"
[[ -z "$(docker network ls -q --filter "label=com.docker.compose.project=$PROJECT")" ]] \
  || fail "networks left after down"
phase
printf '  %s\n' "${TIMES[@]}"
echo "compose_ci: PASS in $(( $(date +%s) - T0 ))s"
