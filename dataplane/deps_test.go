package dataplane_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDataPlaneDoesNotLinkControlPlane keeps the planes apart (CONVENTIONS:
// nothing under dataplane/ imports controlplane/, sql/ or pgx).
func TestDataPlaneDoesNotLinkControlPlane(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/sluicegw/sluice/dataplane/...").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dep := range strings.Split(string(out), "\n") {
		for _, banned := range []string{
			"github.com/sluicegw/sluice/controlplane",
			"github.com/sluicegw/sluice/sql",
			"github.com/jackc/pgx",
		} {
			if dep == banned || strings.HasPrefix(dep, banned+"/") {
				t.Errorf("the data plane links %s", dep)
			}
		}
	}
}
