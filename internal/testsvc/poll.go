package testsvc

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Until calls cond on the caller's goroutine (so cond may use the test's
// t), first at once and then every tick, until it holds or within has
// passed; it reports whether cond held. It is the one poll loop of the
// tests that wait on a condition (e2e/harness re-exports it).
func Until(cond func() bool, within, tick time.Duration) bool {
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(tick)
	}
	return true
}

// Eventually is Until that fails the test (FailNow, with msgAndArgs) when
// cond has not held within; its arguments are those of require.Eventually,
// but cond runs on the test's goroutine.
func Eventually(t testing.TB, cond func() bool, within, tick time.Duration, msgAndArgs ...any) {
	t.Helper()
	if !Until(cond, within, tick) {
		require.FailNow(t, "condition not met within "+within.String(), msgAndArgs...)
	}
}
