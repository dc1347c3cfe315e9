package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestProjectAndTagScopes drives "sluicectl project" and "sluicectl tag"
// against a real control plane: create with limits, list per kind, update
// one limit, refuse what the API refuses, delete.
func TestProjectAndTagScopes(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "labels")["id"].(string)

	p := root.okJSON("project", "create", "search", "--org", orgID, "--max-budget", "50", "--budget-duration", "1mo", "--max-parallel-requests", "4")
	require.Equal(t, "LABEL_SCOPE_KIND_PROJECT", p["kind"])
	require.Equal(t, "search", p["name"])
	require.Equal(t, map[string]any{"max_budget": 50.0, "budget_duration": "1mo", "max_parallel_requests": "4"}, p["limits"])
	tg := root.okJSON("tags", "create", "--name", "nightly", "--org", orgID, "--rpm-limit", "60")
	require.Equal(t, "LABEL_SCOPE_KIND_TAG", tg["kind"])

	var list []map[string]any
	require.NoError(t, json.Unmarshal([]byte(root.ok("project", "list", "--org", orgID, "-o", "json")), &list))
	require.Len(t, list, 1, "project list shows projects only")
	require.Equal(t, p["id"], list[0]["id"])
	require.Contains(t, root.ok("tag", "list", "--org", orgID), "nightly")

	u := root.okJSON("project", "update", p["id"].(string), "--tpm-limit", "9000")
	require.Equal(t, map[string]any{"max_budget": 50.0, "budget_duration": "1mo", "max_parallel_requests": "4", "tpm_limit": "9000"}, u["limits"])
	u = root.okJSON("project", "update", p["id"].(string), "--clear", "max-parallel-requests")
	require.NotContains(t, u["limits"], "max_parallel_requests")

	require.Contains(t, root.fail("project", "create", "search", "--org", orgID), "already_exists")
	require.Contains(t, root.fail("tag", "create", "bad tag", "--org", orgID), "name: tag \"bad tag\" must be")
	require.Contains(t, root.fail("project", "create", "x", "--org", orgID, "--max-budget", "5"), "limits.budget_duration")
	require.Contains(t, root.fail("tag", "create", "x", "--org", orgID, "--allowed-models", "m"), "flag provided but not defined: -allowed-models")

	require.Contains(t, root.ok("project", "delete", p["id"].(string)), "Deleted project")
	require.Contains(t, root.fail("project", "get", p["id"].(string)), "not_found")
	require.Equal(t, "nightly", root.okJSON("tag", "get", tg["id"].(string))["name"])
}
