package dataplane_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestDataPlanePackagesImportNoControlPlaneSQLOrPgx checks that the
// transitive non-test imports of every package under dataplane/ (what
// `go list -deps ./dataplane/...` prints) include no package under
// controlplane/, sql/ or github.com/jackc/pgx. It does not look at test-only
// imports (the whole-system tests start a control plane) nor at cmd/sluice,
// which links both planes by design. depguard (.golangci.yml) enforces the
// direct imports in lint.
func TestDataPlanePackagesImportNoControlPlaneSQLOrPgx(t *testing.T) {
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
