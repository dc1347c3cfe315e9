package usage

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/sluicegw/sluice/internal/testsvc"
)

// TestMain fails the package when a test leaves a goroutine behind.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testsvc.LeakOptions()...)
}
