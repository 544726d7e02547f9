# The late stream of lab/gpu_38.sh and lab/gpu_7b_serve.sh (sourced): big files carried to the GPU machine as ONE byte
# stream cut into parts (the device tool carries <= 64 MiB a call), c1's spare room first, so the job there can start
# on the first file while the rest is still coming. The caller defines `late_files` (names in the order needed).

# late_pack D WH CAP TMP DIGITS: write D/c1/late.manifest (name offset size sha256) and the parts D/cN/late.pNN
late_pack() {
  local D=$1 WH=$2 CAP=$3 T=$4 A=$5 off=0 n sz used first p i
  : > "$D/c1/late.manifest"
  for n in $(late_files); do
    [ -f "$WH/$n" ] || { echo "missing $WH/$n" >&2; return 1; }
    sz=$(stat -c %s "$WH/$n"); echo "$n $off $sz $(sha256sum "$WH/$n" | cut -d' ' -f1)" >> "$D/c1/late.manifest"
    off=$((off + sz))
  done
  used=$(du -sb "$D/c1" | cut -f1); first=$((CAP - used))
  (cd "$WH" && cat $(late_files)) > "$T"
  head -c "$first" "$T" > "$D/c1/late.p$(printf "%0${A}d" 0)"
  tail -c +$((first + 1)) "$T" | split -b "$CAP" -d -a "$A" --numeric-suffixes=1 - "$D/late.p"
  for p in "$D"/late.p*; do i=$((10#${p##*.p})); mkdir -p "$D/c$((i + 1))"; mv "$p" "$D/c$((i + 1))/"; done
  rm -f "$T"
}

# late_carve NAME DEST CARRY: NAME cut out of the parts received in CARRY so far; true once its bytes are whole
late_carve() {
  local n off sz sha
  read -r n off sz sha < <(grep "^$1 " "$3/late.manifest")
  cat $(ls "$3"/late.p* 2>/dev/null | sort) 2>/dev/null | tail -c +$((off + 1)) | head -c "$sz" > "$2/$n"
  [ "$(sha256sum "$2/$n" | cut -d' ' -f1)" = "$sha" ]
}
