# shellcheck shell=bash
# The bad-input half of the probe (sourced by probe.sh): every row of cases.txt run in its own
# directory, judged by its exit status and output. Setup helpers used by the table are here.

# The case's copies of fixtures, in the case directory (the working directory of the case).
adapter() { cp -r "$FX/adapter" adapter; }
adapter_qv() { cp -r "$FX/adapter-qv" adapter; }
base() { cp -r "$FX/base" base; }
shards() { cp -r "$FX/shards-0.1" shards; }
run_of() { cp -r "$FX/ref-$1" run; }

# File $2 of the latest checkpoint of run directory $1.
ckpt_file() { printf '%s/checkpoints/%s/%s\n' "$1" "$(cat "$1/checkpoints/latest")" "$2"; }

# Tensor number V (the case's variant) of safetensors file $1.
nth() { st_nth "$1" "$V"; }

# A seeded element index of tensor $2 of safetensors file $1 (element 0 for variant 0).
elem() {
    local n
    n=$(st_numel "$1" "$2")
    echo $(((V * 7919) % n))
}

# Writes value $2 into tensor number V of safetensors file $1 at a seeded element.
poison() {
    local name
    name=$(nth "$1")
    st_poke "$1" "$name" "$2" "$(elem "$1" "$name")"
}

# The path of the first train shard of the case's shards.
shard0() { printf '%s\n' shards/train-*.tok | head -1; }

# The token count of shard $1's body (u16 tokens after the 64-byte header; the body may
# also hold document offsets after them, left alone).
flip_token() {
    local size
    size=$(stat -c %s "$1")
    flip_byte "$1" $((64 + 2 * ((V * 104729) % ((size - 64) / 4))))
}

# The shared `train` flags of the cases: a few steps of the chat base.
TRAIN_TAIL='--block-size 48 --batch-size 4 --max-iters 2 --eval-interval 2 --eval-iters 1 --peak-flops 1e12 --out-dir out'

# The first line of a case's output worth showing: an error line, else the last line.
first_error() {
    local line
    line=$(grep -m1 -iE 'error|panick|refus|cannot|invalid' "$1" || tail -1 "$1")
    printf '%s' "${line:0:200}" | tr '\t' ' '
}

# Runs case $2 (class $1) of the table: setup $6, trainer arguments $7, variant V; judges it
# by $4 (refuse: an exit status other than 0, a panic, a timeout or a signal, and output
# matching the ERE $5; ok: exit 0). A 30 s limit and 8 GiB of address space each.
run_case() {
    local class=$1 name=$2 issue=$3 expect=$4 names=$5 setup=$6 cmd=$7
    local C="$W/cases/$class-$name-$V" rc verdict=pass got detail args
    mkdir -p "$C"
    if ! (cd "$C" && eval "$setup") >"$C.setup" 2>&1; then
        record input "$class" "$name#$V" "$issue" "$expect" setup fail "setup failed: $(tail -1 "$C.setup")"
        return
    fi
    eval "args=($cmd)"
    # (The braces keep the shell's own "Aborted" / "Killed" notices out of the output.)
    { (cd "$C" && ulimit -v 8388608 && timeout -k 5 30 "$T" "${args[@]}") >"$C.out" 2>&1 </dev/null; } 2>/dev/null &&
        rc=0 || rc=$?
    detail=$(first_error "$C.out")
    got="exit $rc"
    case $expect:$rc in
    ok:0) ;;
    ok:*) verdict=fail ;;
    refuse:0) verdict=fail got="exit 0 (accepted)" ;;
    refuse:101) verdict=fail got="exit 101 (panic)" ;;
    refuse:124 | refuse:137) verdict=fail got="exit $rc (hang: killed after 30 s)" ;;
    refuse:*)
        if ((rc > 128)); then
            verdict=fail got="exit $rc (signal $((rc - 128)))"
        elif ! grep -Eq "$names" "$C.out"; then
            verdict=fail got="exit $rc (not naming /$names/)"
        fi
        ;;
    esac
    record input "$class" "$name#$V" "$issue" "$expect" "$got" "$verdict" "$detail"
}

# Every row of cases.txt: variant 0 in quick mode, variants 0..N-1 (its `full` column) in
# full mode.
run_inputs() {
    local class name issue expect names full setup cmd n
    while IFS=$'\t' read -r class name issue expect names full setup cmd; do
        [[ -z $class || $class == \#* ]] && continue
        class=$(xargs <<<"$class") name=$(xargs <<<"$name") issue=$(xargs <<<"$issue")
        expect=$(xargs <<<"$expect") full=$(xargs <<<"$full")
        names=$(sed 's/^ *//; s/ *$//' <<<"$names")
        setup=$(sed 's/^ *//; s/ *$//' <<<"$setup")
        cmd=$(sed 's/^ *//; s/ *$//' <<<"$cmd")
        [[ -n $cases ]] && ! grep -Eq -- "$cases" <<<"$class $name" && continue
        if [[ $cmd == *$'\t'* || -z $cmd ]]; then
            record input "$class" "$name" "$issue" "$expect" "8 fields" fail \
                "cases.txt: this row has not 8 fields (' | ' inside a field?)"
            continue
        fi
        n=1
        [[ $mode == full ]] && n=$full
        for ((V = 0; V < n; V++)); do
            run_case "$class" "$name" "$issue" "$expect" "$names" "$setup" "$cmd"
        done
    done < <(sed 's/ | /\t/g' "$here/cases.txt")
}
