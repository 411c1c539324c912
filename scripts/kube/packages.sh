# Sourced by build.sh and image.sh, which run at once on a fresh machine.

# apt takes its locks without waiting (the second `apt-get update` failed with "Could not get lock
# /var/lib/apt/lists/lock"): one apt command at a time, by flock.
apt_locked() {
  flock /var/lock/rlfleet-apt.lock "$@"
}

ensure_packages() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${db:Status-Status}' "$package" 2>/dev/null | grep -qx installed || missing+=("$package")
  done
  [ "${#missing[@]}" -gt 0 ] || return 0
  echo "rlfleet: installing ${missing[*]}" >&2
  apt_locked apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt_locked apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Refuses to start a build the disk cannot hold: a build that fills it fails every other test of the session
# (each that writes a file), not just itself.
ensure_space() {  # GiB path
  local free
  free=$(df --output=avail -BG "$2" | tail -1 | tr -dc 0-9)
  [ "$free" -ge "$1" ] && return
  echo "rlfleet: $2 has $free GiB free and this build needs about $1 GiB: free some space, or point" \
    "XDG_CACHE_HOME at a larger disk" >&2
  exit 1
}
