# shellcheck shell=bash
# The probe's fixtures and its kinds of killed run (sourced by probe.sh, which sets T, W, the
# counts and `record`). Every kill is SIGKILL at a seeded random point; what follows it is
# compared with an uninterrupted reference run made here.

# A never-ready descriptor: `read -t` on it sleeps without starting a process.
exec {nap_fd}<> <(:)
nap() { read -rt "$1" -u "$nap_fd" || true; }

now_ms() { echo $(($(date +%s%N) / 1000000)); }

# A seeded random integer in [$1, $2].
rand_in() { echo $(($1 + (RANDOM * 32768 + RANDOM) % ($2 - $1 + 1))); }

# SFT chats over the chat base's vocabulary (the letter after one letter; copying letters):
# $1 records, seed $2.
gen_chats() {
    awk -v n="$1" -v seed="$2" 'BEGIN {
        srand(seed); L = "abcdefghijklmnopqrstuvwxyz"
        for (i = 0; i < n; i++) {
            k = int(rand() * 25)
            if (rand() < 0.5) {
                q = "Write the letter after " substr(L, k + 1, 1); a = substr(L, k + 2, 1)
            } else {
                a = ""; m = 2 + int(rand() * 4)
                for (j = 0; j < m; j++) a = a (j ? " " : "") substr(L, int(rand() * 26) + 1, 1)
                q = "Write each letter : " a
            }
            printf "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"},", q
            printf "{\"role\":\"assistant\",\"content\":\"%s\"}]}\n", a
        }
    }'
}

# JSONL documents of letters (field "text"): $1 lines, seed $2.
gen_corpus() {
    awk -v n="$1" -v seed="$2" 'BEGIN {
        srand(seed); L = "abcdefghijklmnopqrstuvwxyz"
        for (i = 0; i < n; i++) {
            s = "Write each letter :"; m = 4 + int(rand() * 40)
            for (j = 0; j < m; j++) s = s " " substr(L, int(rand() * 26) + 1, 1)
            printf "{\"text\":\"%s\"}\n", s
        }
    }'
}

# The `train` flags of kind $1 (full or lora) over the fixtures: 12 steps of the chat base on
# the chats, a checkpoint every 2 steps (the last 2 kept), dropout so that resume must
# restore its keys.
train_args() {
    local args=(--init-from "$FX/base" --data sft --data-path "$FX/chats.jsonl"
        --block-size 48 --batch-size 8 --eval-iters 1
        --warmup-iters 2 --lr 3e-3 --min-lr 1e-4 --weight-decay 0 --peak-flops 1e12)
    case $1 in
    full) args+=(--max-iters 12 --eval-interval 2 --dropout 0.1) ;;
    lora) args+=(--max-iters 12 --eval-interval 2 --lora-r 4 --lora-alpha 8 --lora-dropout 0.1) ;;
    qv) args+=(--max-iters 1 --eval-interval 1 --lora-r 4 --lora-targets "q_proj,v_proj") ;;
    esac
    printf '%s\n' "${args[@]}"
}

# `prepare` flags writing to $1, with validation fraction $2, on $3 threads (default 2).
prepare_args() {
    printf '%s\n' "$FX/corpus.jsonl" --out-dir "$1" --tokenizer "$FX/base/tokenizer.json" \
        --shard-tokens 20000 --val-fraction "$2" --chunk-bytes 16384 --threads "${3:-2}" --quiet
}

# Runs the trainer quietly with $@; its output in $W/log/NAME ($1 is NAME).
quiet() {
    local name=$1 && shift
    mkdir -p "$W/log"
    "$T" "$@" >"$W/log/$name" 2>&1 || {
        echo "probe: trainer $* failed (log $W/log/$name):" >&2
        tail -5 "$W/log/$name" >&2
        return 1
    }
}

# Builds everything the probe reads into $W/fx (FX): the chat base, chats, a corpus, the
# reference runs (full, LoRA, LoRA on q/v only), their exports and shards.
make_fixtures() {
    FX=$W/fx
    mkdir -p "$FX"
    cp -r "$root/data/chat-base" "$FX/base"
    gen_chats 400 "$seed" >"$FX/chats.jsonl"
    gen_corpus 20000 "$seed" >"$FX/corpus.jsonl"
    local kind t0 args
    for kind in full lora qv; do
        mapfile -t args < <(train_args "$kind")
        t0=$(now_ms)
        quiet "ref-$kind" train "${args[@]}" --out-dir "$FX/ref-$kind"
        declare -g "ms_$kind=$(($(now_ms) - t0))"
    done
    quiet export-adapter export "$FX/ref-lora" "$FX/adapter"
    quiet export-merged export "$FX/ref-lora" "$FX/merged" --merge
    quiet export-qv export "$FX/ref-qv" "$FX/adapter-qv"
    quiet export-base2 export "$FX/ref-full" "$FX/base2" --dtype bf16
    for v in 0 0.01 0.1; do
        mapfile -t args < <(prepare_args "$FX/shards-$v" "$v")
        t0=$(now_ms)
        quiet "prepare-$v" prepare "${args[@]}"
        declare -g "ms_prepare_${v/./}=$(($(now_ms) - t0))"
    done
    # The same shards on one thread: the bytes must not depend on --threads.
    mapfile -t args < <(prepare_args "$FX/shards-1thread" 0.1 1)
    quiet prepare-1thread prepare "${args[@]}"
    if diff -r -q "$FX/shards-0.1" "$FX/shards-1thread" >/dev/null; then
        record threads prepare 1-vs-2 - identical identical pass "prepare --threads 1 and 2"
    else
        record threads prepare 1-vs-2 - identical different fail "prepare --threads 1 and 2"
    fi
    echo "probe: fixtures ready (train ${ms_full} ms full, ${ms_lora} ms LoRA; prepare ${ms_prepare_0} ms)"
}

# metrics.jsonl of run $1 without its timings (the records resume must reproduce).
records() {
    jq -c 'del(.tokens_per_sec, .step_ms, .mfu)' "$1/metrics.jsonl"
}

# The safetensors files of run $1's latest checkpoint, one path a line.
final_tensors() {
    local latest
    latest=$(cat "$1/checkpoints/latest")
    printf '%s\n' "$1/checkpoints/$latest"/*.safetensors
}

# Starts the trainer with arguments $4... (output appended to $3/log) and SIGKILLs it after
# $1 ms, or, when $2 is a glob, as soon as a path matching it appears (then after $1 ms more);
# says whether it was killed or had finished. The notice of the shell on the killed job goes
# nowhere.
kill_at() {
    local ms=$1 pat=$2 log=$3/log pid
    shift 3
    {
        "$T" "$@" >>"$log" 2>&1 &
        pid=$!
        if [[ -n $pat ]]; then
            while kill -0 "$pid" 2>/dev/null && ! compgen -G "$pat" >/dev/null; do
                nap 0.002
            done
        fi
        nap "$((ms / 1000)).$(printf %03d $((ms % 1000)))"
        if kill -9 "$pid" 2>/dev/null; then
            echo killed
        else
            echo finished
        fi
        wait "$pid" || true
    } 2>/dev/null
}

# Kill $2 of a `train` run of kind $1 (full or lora); mid-checkpoint when $3 is 1. Resumes
# until the run finishes, then checks that no partial checkpoint is left and compares the
# final checkpoint's tensors and every record of metrics.jsonl with the reference run.
kill_train() {
    local kind=$1 i=$2 mid=$3 dir="$W/kills/train-$1-$2" args ref="$FX/ref-$1" ms=0 step=
    local landed where resumes=0 rc detail verdict=pass
    mapfile -t args < <(train_args "$kind")
    local ref_ms="ms_$kind" pat=
    if ((mid)); then
        step=$((2 * $(rand_in 1 6)))
        pat="$dir/run/checkpoints/.tmp-step-$(printf %07d "$step")-*"
        ms=$(rand_in 0 3)
        where="${ms} ms into step $step's checkpoint"
    else
        ms=$(rand_in 200 $((${!ref_ms} * 9 / 10)))
        where="at ${ms} ms"
    fi
    mkdir -p "$dir"
    landed=$(kill_at "$ms" "$pat" "$dir" train "${args[@]}" --out-dir "$dir/run")
    local tmp=("$dir/run/checkpoints"/.tmp-*)
    ((${#tmp[@]})) && where+=" (a checkpoint was being written)"
    rc=0
    while [[ $landed == killed ]] && ((resumes < 3)); do
        resumes=$((resumes + 1))
        if [[ -s $dir/run/checkpoints/latest ]]; then
            "$T" train --resume "$dir/run" >>"$dir/log" 2>&1 && rc=0 || rc=$?
        else
            "$T" train "${args[@]}" --out-dir "$dir/run" --overwrite >>"$dir/log" 2>&1 && rc=0 || rc=$?
        fi
        ((rc == 0)) && break
    done
    local class="train-$kind"
    ((${#tmp[@]})) && class+="-midckpt"
    local left=("$dir/run/checkpoints"/.tmp-* "$dir/run/checkpoints"/.old-*)
    if ((rc != 0)); then
        verdict=fail detail="rerun exit $rc: $(grep -m1 -i error "$dir/log" || true)"
    elif ((${#left[@]})); then
        verdict=fail detail="left behind: ${left[*]##*/}"
    elif ! diff <(records "$ref") <(records "$dir/run") >/dev/null; then
        verdict=fail detail="metrics.jsonl records differ from the reference"
    else
        local f
        for f in $(final_tensors "$ref"); do
            st_same "$f" "$(final_tensors "$dir/run" | grep "/${f##*/}$")" ||
                { verdict=fail detail="${f##*/} differs from the reference" && break; }
        done
    fi
    [[ $verdict == pass ]] &&
        detail="records=$(records "$ref" | wc -l) identical, final tensors identical"
    # Where the reruns started: a resume at a checkpoint's step, or afresh (killed before one).
    local from
    from=$(grep -o 'resuming .* at step [0-9]*' "$dir/log" | grep -o '[0-9]*$' | paste -sd, - || true)
    detail="${from:+resumed at step $from; }$detail"
    record kill "$class" "$i" - "$landed+exact" "$landed+$verdict" "$verdict" \
        "$where; $resumes rerun(s); $detail"
}

# Kill $1 of `prepare` with validation fraction $2: rerun the same command, compare every
# byte with the reference shards; a rerun after finished shards must not start from document 0.
kill_prepare() {
    local i=$1 v=$2 out="$W/kills/prepare-$1" args ms landed rc verdict=pass detail ref_ms
    ref_ms="ms_prepare_${v/./}"
    ref_ms=${!ref_ms}
    ms=$(rand_in 100 $((ref_ms * 9 / 10)))
    mkdir -p "$out"
    mapfile -t args < <(prepare_args "$out/shards" "$v")
    landed=$(kill_at "$ms" "" "$out" prepare "${args[@]}")
    # Where a rerun starts reading: progress.json's resume point (prepare's own record).
    local n doc
    n=$(find "$out/shards" -maxdepth 1 -name 'train-*.tok' | wc -l)
    doc=$(jq -r '.resume.doc // empty' "$out/shards/progress.json" 2>/dev/null || true)
    "$T" prepare "${args[@]}" >>"$out/log" 2>&1 && rc=0 || rc=$?
    if [[ $landed == killed && -n $doc ]]; then
        local kv=pass
        ((n > 0 && doc == 0)) && kv=fail
        record kill "prepare-val$v-resumes" "$i" 32 "resumes after finished shards" \
            "$n shards, resume at doc $doc" "$kv" \
            "at ${ms} ms; $n train shards were finished; the rerun reads on from document $doc"
    fi
    if ((rc != 0)); then
        verdict=fail detail="rerun exit $rc: $(grep -m1 -i error "$out/log" || true)"
    elif ! diff -r -q "$FX/shards-$v" "$out/shards" >"$out/diff" 2>&1; then
        verdict=fail detail="shards differ: $(head -1 "$out/diff")"
    else
        detail="$(find "$out/shards" -type f | wc -l) files byte-identical"
    fi
    record kill "prepare-val$v" "$i" - "$landed+exact" "$landed+$verdict" "$verdict" \
        "at ${ms} ms; $detail"
}

# Kill $1 of `export` (adapter, or merged when $2 is 1), a few ms after its temporary
# directory appears: the output is absent or complete
# right after the kill; a rerun (--force) succeeds, leaves no temporary directory, equals
# the reference and loads (`inspect`).
kill_export() {
    local i=$1 merge=$2 dir="$W/kills/export-$1" ref flags=() ms landed rc verdict=pass detail
    ((merge)) && flags=(--merge) ref="$FX/merged" || ref="$FX/adapter"
    ms=$(rand_in 0 5)
    mkdir -p "$dir"
    landed=$(kill_at "$ms" "$dir/.out.tmp-*" "$dir" export "$FX/ref-lora" "$dir/out" "${flags[@]}")
    if [[ -e $dir/out ]] && ! same_dir "$ref" "$dir/out"; then
        verdict=fail detail="a partial output right after the kill"
    fi
    "$T" export "$FX/ref-lora" "$dir/out" "${flags[@]}" --force >>"$dir/log" 2>&1 && rc=0 || rc=$?
    local left=("$dir"/.out.*)
    if [[ $verdict == fail ]]; then
        :
    elif ((rc != 0)); then
        verdict=fail detail="rerun exit $rc: $(grep -m1 -i error "$dir/log" || true)"
    elif ((${#left[@]})); then
        verdict=fail detail="left behind: ${left[*]##*/}"
    elif ! same_dir "$ref" "$dir/out"; then
        verdict=fail detail="the rerun's output differs from the reference"
    elif ! "$T" inspect "$dir/out" >>"$dir/log" 2>&1; then
        verdict=fail detail="the output does not load (inspect)"
    else
        detail="no temporaries, identical, loads"
    fi
    local class=export-adapter
    ((merge)) && class=export-merge
    record kill "$class" "$i" - "$landed+exact" "$landed+$verdict" "$verdict" \
        "${ms} ms after its temporary directory appeared; $detail"
}

# Every kill of this mode: train (full, LoRA; every mid_every-th one mid-checkpoint),
# prepare (with and without a validation split), export (adapter, merged).
run_kills() {
    local i
    for ((i = 0; i < kills_full; i++)); do kill_train full "$i" $((i % mid_every == mid_every - 1)); done
    for ((i = 0; i < kills_lora; i++)); do kill_train lora "$i" $((i % mid_every == mid_every - 1)); done
    local fractions=(0 0.01 0.1)
    for ((i = 0; i < kills_prepare; i++)); do kill_prepare "$i" "${fractions[i % 3]}"; done
    for ((i = 0; i < kills_export; i++)); do kill_export "$i" $((i % 2)); done
}

# The summary table: per kind and class, the count, passed, failed, and failures of cases
# marked as fixed by issue #32; the kill totals.
summarise() {
    printf '%-8s %-24s %6s %6s %6s %9s\n' kind class cases pass fail 'fail(#32)'
    awk -F'\t' 'NR > 1 {
        key = $1 "\t" $2; n[key]++
        if ($7 == "pass") p[key]++; else { f[key]++; if ($4 != "-") fi[key]++ }
    } END {
        for (k in n) { split(k, a, "\t"); printf "%-8s %-24s %6d %6d %6d %9d\n", a[1], a[2], n[k], p[k], f[k], fi[k] }
    }' "$results" | sort
    awk -F'\t' 'NR > 1 {
        total++; if ($7 == "pass") passed++; else if ($4 != "-") issue++
        if ($1 == "kill" && $6 ~ /^killed/) {
            kills++; if ($7 == "pass") exact++; if ($2 ~ /midckpt/) mid++
            if (match($8, /records=[0-9]+/)) recs += substr($8, RSTART + 8, RLENGTH - 8)
        }
    } END {
        printf "total: %d checks, %d passed, %d failed (%d of them marked to be fixed by #32)\n", total, passed, total - passed, issue
        printf "kills: %d landed (%d mid-checkpoint), %d resumed or rerun exactly; %d metrics records compared identical\n", kills, mid, exact, recs
    }' "$results"
}
