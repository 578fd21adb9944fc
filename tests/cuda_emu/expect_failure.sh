#!/bin/sh
# expect_failure.sh REGEX COMMAND [ARGS...]: the mutation tests' runner.
# Passes when COMMAND fails (non-zero exit, or killed by a signal) and its
# output (stdout and stderr) matches the extended REGEX; fails otherwise,
# so a mutant that the emulator no longer catches turns the test red.
regex=$1
shift
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out" | tail -n 25
if [ "$rc" -eq 0 ]; then
    echo "expect_failure: the mutant passed (exit 0); the emulator did not catch it"
    exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq "$regex"; then
    echo "expect_failure: exit $rc, but nothing in the output matches /$regex/"
    exit 1
fi
echo "expect_failure: caught as expected (exit $rc, output matches /$regex/)"
exit 0
