package admin

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// TestTrustedIssuers: creation validates every field and names the bad
// one, (issuer, audience) is unique across orgs, the default team must be
// the org's, a team-scoped token cannot manage issuers, and creation and
// deletion are audited and queued as events (the deletion a security
// event).
func TestTrustedIssuers(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	c := b.root()
	org, other := b.mkOrg("iss-a"), b.mkOrg("iss-b")
	team, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: "default"}))
	require.NoError(t, err)
	otherTeam, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: other.Id, Name: "x"}))
	require.NoError(t, err)
	base := func() *adminv1.CreateTrustedIssuerRequest {
		return &adminv1.CreateTrustedIssuerRequest{OrgId: org.Id, Issuer: "https://idp.example.com/realms/a", Audience: "sluice",
			TeamClaim: "groups.primary", UserClaim: "email"}
	}
	for _, tc := range []struct {
		name, field string
		edit        func(*adminv1.CreateTrustedIssuerRequest)
	}{
		{"no issuer", "issuer", func(r *adminv1.CreateTrustedIssuerRequest) { r.Issuer = "" }},
		{"http issuer", "issuer", func(r *adminv1.CreateTrustedIssuerRequest) { r.Issuer = "http://idp.example.com" }},
		{"issuer with query", "issuer", func(r *adminv1.CreateTrustedIssuerRequest) { r.Issuer = "https://idp.example.com/?a=b" }},
		{"relative jwks", "jwks_url", func(r *adminv1.CreateTrustedIssuerRequest) { r.JwksUrl = "/jwks" }},
		{"no audience", "audience", func(r *adminv1.CreateTrustedIssuerRequest) { r.Audience = "" }},
		{"bad claim path", "team_claim", func(r *adminv1.CreateTrustedIssuerRequest) { r.TeamClaim = "groups..primary" }},
		{"claim with space", "user_claim", func(r *adminv1.CreateTrustedIssuerRequest) { r.UserClaim = "e mail" }},
		{"default policy without team", "default_team_id", func(r *adminv1.CreateTrustedIssuerRequest) {
			r.UnknownPolicy = adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_DEFAULT_TEAM
		}},
		{"no team claim without default", "default_team_id", func(r *adminv1.CreateTrustedIssuerRequest) { r.TeamClaim = "" }},
		{"ignored default team", "default_team_id", func(r *adminv1.CreateTrustedIssuerRequest) { r.DefaultTeamId = team.Msg.Team.Id }},
		{"team of another org", "default_team_id", func(r *adminv1.CreateTrustedIssuerRequest) {
			r.TeamClaim, r.DefaultTeamId = "", otherTeam.Msg.Team.Id
		}},
		{"unknown policy", "unknown_policy", func(r *adminv1.CreateTrustedIssuerRequest) { r.UnknownPolicy = 9 }},
	} {
		req := base()
		tc.edit(req)
		_, err := c.Issuer.CreateTrustedIssuer(ctx, connect.NewRequest(req))
		require.Equal(t, "invalid_argument", codeOf(err), tc.name)
		require.Contains(t, err.Error(), tc.field, tc.name)
	}
	audits := b.auditCount()
	req := base()
	req.JwksUrl = "http://127.0.0.1:9/jwks" // loopback may be http
	created, err := c.Issuer.CreateTrustedIssuer(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	got := created.Msg.Issuer
	require.Equal(t, adminv1.UnknownIdentityPolicy_UNKNOWN_IDENTITY_POLICY_REFUSE, got.UnknownPolicy, "refuse by default")
	require.Equal(t, audits+1, b.auditCount())
	dup := base()
	dup.OrgId = other.Id
	_, err = c.Issuer.CreateTrustedIssuer(ctx, connect.NewRequest(dup))
	require.Equal(t, "already_exists", codeOf(err), "(issuer, audience) is unique across orgs")

	lenient := base()
	lenient.Audience, lenient.TeamClaim, lenient.DefaultTeamId = "other-aud", "", team.Msg.Team.Id
	_, err = c.Issuer.CreateTrustedIssuer(ctx, connect.NewRequest(lenient))
	require.NoError(t, err)

	list, err := c.Issuer.ListTrustedIssuers(ctx, connect.NewRequest(&adminv1.ListTrustedIssuersRequest{OrgId: org.Id}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Issuers, 2)

	teamTok := b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, org.Id, team.Msg.Team.Id)
	_, err = b.as(teamTok).Issuer.CreateTrustedIssuer(ctx, connect.NewRequest(func() *adminv1.CreateTrustedIssuerRequest {
		r := base()
		r.Audience = "team-try"
		return r
	}()))
	require.Equal(t, "permission_denied", codeOf(err))

	_, err = c.Issuer.DeleteTrustedIssuer(ctx, connect.NewRequest(&adminv1.DeleteTrustedIssuerRequest{Id: got.Id}))
	require.NoError(t, err)
	_, err = c.Issuer.GetTrustedIssuer(ctx, connect.NewRequest(&adminv1.GetTrustedIssuerRequest{Id: got.Id}))
	require.Equal(t, "not_found", codeOf(err))
	var kinds []string
	rows, err := b.pool.Query(ctx, `SELECT kind FROM outbox WHERE object_id = $1 ORDER BY seq`, got.Id)
	require.NoError(t, err)
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		kinds = append(kinds, k)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{"trusted_issuer.upserted", "trusted_issuer.deleted"}, kinds)
}
