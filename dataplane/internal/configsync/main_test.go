package configsync

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// TestMain fails the package when a test leaves a goroutine behind (the
// Syncer's heartbeat loop and event consumers must stop with its context).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testsvc.LeakOptions()...)
}
