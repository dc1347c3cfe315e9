package harness

import (
	"testing"
	"time"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// Until calls cond on the caller's goroutine, first at once and then
// every tick, until it holds or within has passed, and reports whether it
// held (testsvc.Until: the one poll loop of the tests).
func Until(cond func() bool, within, tick time.Duration) bool {
	return testsvc.Until(cond, within, tick)
}

// Eventually fails the test (FailNow, with msgAndArgs) when cond has not
// held within; its arguments are those of require.Eventually, but cond
// runs on the test's goroutine (testsvc.Eventually).
func Eventually(t testing.TB, cond func() bool, within, tick time.Duration, msgAndArgs ...any) {
	t.Helper()
	testsvc.Eventually(t, cond, within, tick, msgAndArgs...)
}
