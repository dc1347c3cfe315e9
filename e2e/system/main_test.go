package system

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// TestMain fails the package when a test leaves a goroutine behind: every
// plane, server and client a test starts must be stopped at its cleanup.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testsvc.LeakOptions()...)
}
