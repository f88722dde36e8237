# Sourced by deploy/build-image.sh and deploy/compose-test.sh.
# available IMAGE...: every image given is on the engine, or a pull brings it now.
available() {
    local image
    for image in "$@"; do
        ${DOCKER:-docker} image inspect "$image" >/dev/null 2>&1 \
            || ${DOCKER:-docker} pull -q "$image" >/dev/null 2>&1 || return 1
    done
}
