package main

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTokenCreateWithTeamResolvesTheOrg: a platform token (which has no
// org of its own) creates a team token from --team alone.
func TestTokenCreateWithTeamResolvesTheOrg(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	env := newCLIEnv(t)
	root := env.with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	orgID := root.okJSON("org", "create", "team-token-org")["id"].(string)
	teamID := root.okJSON("team", "create", "eng", "--org", orgID)["id"].(string)

	r := root.run("-o", "json", "token", "create", "--team", teamID, "--role", "viewer")
	require.Equal(t, 0, r.code, r.stderr)
	var created map[string]any
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &created))
	tok := obj(t, created, "admin_token")
	require.Equal(t, "SCOPE_TEAM", tok["scope"])
	require.Equal(t, orgID, tok["org_id"])
	require.Equal(t, teamID, tok["team_id"])

	r = root.run("token", "create", "--team", "team_missing", "--role", "viewer")
	require.NotEqual(t, 0, r.code)
	require.Contains(t, r.stderr, "resolve the org of team team_missing")
}

// TestIssuerCreateLabelClaims: issuer create sends --project-claim and
// --tags-claim (docs/jwt.md), and a bad claim path is the admin API's
// invalid_argument naming the field.
func TestIssuerCreateLabelClaims(t *testing.T) {
	t.Parallel()
	server, _ := startServer(t)
	root := newCLIEnv(t).with("SLUICE_SERVER="+server, "SLUICE_TOKEN="+bootstrapToken)
	org := root.okJSON("org", "create", "idp")["id"].(string)
	team := root.okJSON("team", "create", "t", "--org", org)["id"].(string)
	got := root.okJSON("issuer", "create", "http://127.0.0.1:9/realm", "--org", org, "--audience", "sluice",
		"--default-team", team, "--project-claim", "ctx.project", "--tags-claim", "groups")
	require.Equal(t, "ctx.project", firstOf(got, "project_claim", "projectClaim"))
	require.Equal(t, "groups", firstOf(got, "tags_claim", "tagsClaim"))
	msg := root.fail("issuer", "create", "http://127.0.0.1:9/other", "--org", org, "--audience", "sluice",
		"--default-team", team, "--tags-claim", "a..b")
	require.Contains(t, msg, "invalid_argument")
	require.Contains(t, msg, "tags_claim")
}
