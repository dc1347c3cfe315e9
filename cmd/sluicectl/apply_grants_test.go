package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// grantsFile declares two orgs and a group granted to one of them (created
// in the same run), with no deployment.
const grantsFile = `
kind: Org
name: alpha
---
kind: Org
name: beta
---
kind: ModelGroup
name: private-llm
granted_orgs: [alpha]
`

// TestApplyGrantsModelGroups: granted_orgs grants a group to orgs the file
// creates in the same run; re-applying changes nothing; adding an org is
// one grant; leaving one out revokes it only with --prune; get -o yaml
// writes the grants back; an unknown org is refused before anything
// changes.
func TestApplyGrantsModelGroups(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	file := filepath.Join(t.TempDir(), "grants.yaml")
	write := func(s string) { require.NoError(t, os.WriteFile(file, []byte(s), 0o600)) }
	write(grantsFile)

	out := root.ok("apply", "-f", file)
	require.Equal(t, []string{"+ Grant of ModelGroup private-llm to org alpha", "+ ModelGroup private-llm", "+ Org alpha", "+ Org beta"}, planLines(out))
	grants := root.ok("model-group", "grants", "--model-group", "private-llm", "-o", "json")
	orgID := func(name string) string {
		var orgs []map[string]any
		require.NoError(t, json.Unmarshal([]byte(root.ok("org", "list", "--name-prefix", name, "-o", "json")), &orgs))
		require.Len(t, orgs, 1)
		return orgs[0]["id"].(string)
	}
	alpha, beta := orgID("alpha"), orgID("beta")
	require.Contains(t, grants, alpha)
	require.NotContains(t, grants, beta)
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file))

	write(strings.Replace(grantsFile, "[alpha]", "[alpha, beta]", 1))
	require.Equal(t, []string{"+ Grant of ModelGroup private-llm to org beta"}, planLines(root.ok("apply", "-f", file)))
	y := root.ok("get", "model-group", "private-llm", "-o", "yaml")
	require.Contains(t, y, "granted_orgs:\n  - alpha\n  - beta")
	r := root.runIn(y, "apply", "-f", "-")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, "Applied: no changes.\n", r.stdout)

	// An org token reads the group it is granted (its grants as far as it may see them).
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("token", "create", "--scope", "org", "--org", alpha, "--role", "viewer", "--name", "alpha-viewer", "-o", "json")), &created))
	viewer := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+created["token"].(string))
	require.Contains(t, viewer.ok("get", "model-group", "private-llm", "-o", "yaml"), "name: private-llm")

	// Leaving beta out revokes nothing without --prune.
	write(grantsFile)
	require.Equal(t, "Applied: no changes.\n", root.ok("apply", "-f", file))
	dry := root.ok("apply", "-f", file, "--prune", "--dry-run")
	require.Contains(t, dry, "- Grant of ModelGroup private-llm to org beta")
	require.Contains(t, dry, "a revocation")
	out = root.ok("apply", "-f", file, "--prune", "--yes")
	require.Contains(t, out, "- Grant of ModelGroup private-llm to org beta")
	require.NotContains(t, root.ok("model-group", "grants", "--model-group", "private-llm", "-o", "json"), beta)

	// A file without granted_orgs leaves the grants alone, prune or not.
	write(strings.Replace(grantsFile, "granted_orgs: [alpha]\n", "", 1))
	require.NotContains(t, root.ok("apply", "-f", file, "--prune", "--yes", "--dry-run"), "Grant of")

	write(strings.Replace(grantsFile, "[alpha]", "[alpha, gamma]", 1))
	require.Contains(t, root.fail("apply", "-f", file), `granted_orgs: org "gamma" does not exist and the file does not declare it`)
	write(strings.Replace(grantsFile, "[alpha]", "[alpha, alpha]", 1))
	require.Contains(t, root.fail("apply", "-f", file), "granted_orgs[1]: org alpha is listed twice")
}
