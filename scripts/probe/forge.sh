# shellcheck shell=bash
# Byte-level forgeries of the probe's inputs (sourced by probe.sh): safetensors tensors and
# headers, token shards, JSON files. Each takes the file to change in place; nothing here
# knows the trainer's code.

# The header length of safetensors file $1 (the little-endian u64 of its first 8 bytes).
st_hlen() {
    od -An -t u8 -N 8 "$1" | tr -d ' '
}

# The JSON header of safetensors file $1.
st_header() {
    dd if="$1" bs=1 skip=8 count="$(st_hlen "$1")" status=none
}

# The tensor names of safetensors file $1, sorted.
st_names() {
    st_header "$1" | jq -r 'del(.__metadata__) | keys[]'
}

# The $2-th tensor name (0-based, modulo the count) of safetensors file $1.
st_nth() {
    local names
    mapfile -t names < <(st_names "$1")
    echo "${names[$(($2 % ${#names[@]}))]}"
}

# Whether safetensors files $1 and $2 hold the same tensors and metadata: the same data bytes
# and the same header once its keys are sorted (the metadata map is written in any order).
st_same() {
    cmp -s <(tail -c +$((9 + $(st_hlen "$1"))) "$1") <(tail -c +$((9 + $(st_hlen "$2"))) "$2") &&
        [[ $(st_header "$1" | jq -S .) == "$(st_header "$2" | jq -S .)" ]]
}

# Whether directories $1 and $2 hold the same files with the same contents (safetensors by
# st_same, others byte for byte).
same_dir() {
    local f
    [[ $(cd "$1" && find . -type f | sort) == "$(cd "$2" && find . -type f | sort)" ]] || return 1
    while read -r f; do
        if [[ $f == *.safetensors ]]; then
            st_same "$1/$f" "$2/$f" || return 1
        else
            cmp -s "$1/$f" "$2/$f" || return 1
        fi
    done < <(cd "$1" && find . -type f)
}

# Replaces the header of safetensors file $1 by jq filter $2 applied to it. A header no longer
# than the old one is padded with spaces (as the format allows) and written in place; a longer
# one rewrites the file.
st_edit_header() {
    local file=$1 filter=$2 old new hlen
    hlen=$(st_hlen "$file")
    old=$(st_header "$file")
    new=$(jq -c "$filter" <<<"$old")
    if ((${#new} <= hlen)); then
        printf '%-*s' "$hlen" "$new" | dd of="$file" bs=1 seek=8 conv=notrunc status=none
    else
        local tmp="$file.forge"
        {
            u64_le "${#new}"
            printf '%s' "$new"
            tail -c +$((9 + hlen)) "$file"
        } >"$tmp"
        mv "$tmp" "$file"
    fi
}

# The 8 little-endian bytes of $1.
u64_le() {
    local n=$1 i out=''
    for ((i = 0; i < 8; i++)); do
        out+=$(printf '\\x%02x' $(((n >> (8 * i)) & 255)))
    done
    printf '%b' "$out"
}

# Writes value $3 (nan, inf, -inf, big = 1e38) into element $4 (default 0) of tensor $2 of
# safetensors file $1, in the tensor's own dtype (F32, BF16 or F16; F16 has no 1e38: inf).
st_poke() {
    local file=$1 name=$2 value=$3 index=${4:-0} meta dtype start width bytes
    meta=$(st_header "$file" | jq -c --arg n "$name" '.[$n]')
    dtype=$(jq -r .dtype <<<"$meta")
    start=$(jq -r '.data_offsets[0]' <<<"$meta")
    case $dtype in
    F32) width=4 ;;
    BF16 | F16) width=2 ;;
    *) echo "st_poke: $file: $name is $dtype" >&2 && return 1 ;;
    esac
    case $dtype:$value in
    F32:nan) bytes='\x00\x00\xc0\x7f' ;;
    F32:inf) bytes='\x00\x00\x80\x7f' ;;
    F32:-inf) bytes='\x00\x00\x80\xff' ;;
    F32:big) bytes='\x99\x76\x96\x7e' ;;
    BF16:nan) bytes='\xc0\x7f' ;;
    BF16:inf) bytes='\x80\x7f' ;;
    BF16:-inf) bytes='\x80\xff' ;;
    BF16:big) bytes='\x96\x7e' ;;
    F16:nan) bytes='\x00\x7e' ;;
    F16:inf | F16:big) bytes='\x00\x7c' ;;
    F16:-inf) bytes='\x00\xfc' ;;
    *) echo "st_poke: unknown value $value" >&2 && return 1 ;;
    esac
    printf '%b' "$bytes" |
        dd of="$file" bs=1 seek=$((8 + $(st_hlen "$file") + start + index * width)) \
            conv=notrunc status=none
}

# The number of elements of tensor $2 of safetensors file $1.
st_numel() {
    st_header "$1" | jq --arg n "$2" '.[$n].shape | reduce .[] as $d (1; . * $d)'
}

# Sets the dtype of tensor $2 of safetensors file $1 to $3 (same width: F32 <-> I32 <-> U32).
st_retype() {
    st_edit_header "$1" "(.[\"$2\"].dtype) = \"$3\""
}

# Reverses the shape of tensor $2 of safetensors file $1 (same bytes, wrong shape).
st_transpose() {
    st_edit_header "$1" "(.[\"$2\"].shape) |= reverse"
}

# Renames tensor $2 of safetensors file $1 to $3.
st_rename() {
    st_edit_header "$1" "with_entries(if .key == \"$2\" then .key = \"$3\" else . end)"
}

# XORs byte $2 of file $1 with $3 (default 1).
flip_byte() {
    local file=$1 at=$2 mask=${3:-1} byte
    byte=$(od -An -t u1 -j "$at" -N 1 "$file" | tr -d ' ')
    printf '%b' "$(printf '\\x%02x' $((byte ^ mask)))" |
        dd of="$file" bs=1 seek="$at" conv=notrunc status=none
}

# Cuts $2 bytes off the end of file $1.
truncate_by() {
    truncate -s "-$2" "$1"
}

# Applies jq filter $2 to JSON file $1 in place.
json_edit() {
    local tmp="$1.forge"
    jq "$2" "$1" >"$tmp" && mv "$tmp" "$1"
}
