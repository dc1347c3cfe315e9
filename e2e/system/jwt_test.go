package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/internal/oidctest"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// TestJWTAcrossPlanes: an issuer registered through the admin API reaches
// the data plane in its configuration; a token of the local OIDC issuer
// (discovery and JWKS on loopback) is accepted by /v1/auth/check as the
// mapped team and user; blocking the user refuses its tokens within 1 s,
// as for keys; deleting the issuer refuses them too (a security event).
func TestJWTAcrossPlanes(t *testing.T) {
	t.Parallel()
	d := harness.Start(t)
	tn := d.NewTenant("jwt-org")
	is := oidctest.Start(t)
	ctx := context.Background()
	issuers := adminv1connect.NewIssuerServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(harness.Bootstrap)))
	created, err := issuers.CreateTrustedIssuer(ctx, connect.NewRequest(&adminv1.CreateTrustedIssuerRequest{
		OrgId: tn.OrgID, Issuer: is.URL(), Audience: "sluice", TeamClaim: "team", UserClaim: "email"}))
	require.NoError(t, err)
	p := d.StartProxy("default", time.Minute)

	tok := is.Sign(oidctest.Claims{Subject: "s", Audience: "sluice", Extra: map[string]any{"team": "team", "email": "jwt-org@example.com"}})
	harness.WaitStatus(t, p, tok, http.StatusOK, 10*time.Second)
	unknown := is.Sign(oidctest.Claims{Subject: "s", Audience: "sluice", Extra: map[string]any{"team": "team", "email": "nobody@example.com"}})
	status, code := harness.Check(t, p, unknown)
	require.Equal(t, http.StatusUnauthorized, status)
	require.Equal(t, "unknown_identity", code)

	c := d.Clients()
	start := time.Now()
	_, err = c.User.BlockUser(ctx, connect.NewRequest(&adminv1.BlockUserRequest{Id: tn.UserID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, tok, http.StatusForbidden, time.Second)
	t.Logf("blocked user's JWT refused %s after the block", time.Since(start))
	_, code = harness.Check(t, p, tok)
	require.Equal(t, "user_blocked", code)
	_, err = c.User.UnblockUser(ctx, connect.NewRequest(&adminv1.UnblockUserRequest{Id: tn.UserID}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, tok, http.StatusOK, 5*time.Second)

	_, err = issuers.DeleteTrustedIssuer(ctx, connect.NewRequest(&adminv1.DeleteTrustedIssuerRequest{Id: created.Msg.Issuer.Id}))
	require.NoError(t, err)
	harness.WaitStatus(t, p, tok, http.StatusUnauthorized, time.Second)
}

// TestJWTProjectAndTagScopes: an issuer maps a claim to the project and
// one to the tags of its tokens' requests; a JWT request is counted against
// the org's project scope (then tag scope) like a key's: the second request
// in the minute of a scope with rpm_limit 1 is 429 naming that scope. A
// claim value a key could not carry as project or tag refuses the token;
// a bad claim path is the admin API's InvalidArgument.
func TestJWTProjectAndTagScopes(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	up := settingsUpstream(t)
	m := d.modelClient()
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "m", PlatformWide: true}))
	require.NoError(t, err)
	_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: "m", ApiBase: up,
		UpstreamModel: "up", Weight: 1, Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 1e-6}}))
	require.NoError(t, err)
	tn := d.NewTenant("jwt-labels")
	one := int64(1)
	scope := func(kind adminv1.LabelScopeKind, name string) string {
		ls, err := d.labelScopeClient().CreateLabelScope(ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{
			OrgId: tn.OrgID, Kind: kind, Name: name, Limits: &adminv1.Limits{RpmLimit: &one}}))
		require.NoError(t, err)
		return ls.Msg.LabelScope.Id
	}
	project := scope(adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, "search")
	tag := scope(adminv1.LabelScopeKind_LABEL_SCOPE_KIND_TAG, "eval")
	is := oidctest.Start(t)
	issuers := adminv1connect.NewIssuerServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(harness.Bootstrap)))
	_, err = issuers.CreateTrustedIssuer(ctx, connect.NewRequest(&adminv1.CreateTrustedIssuerRequest{
		OrgId: tn.OrgID, Issuer: is.URL(), Audience: "sluice", TeamClaim: "team", UserClaim: "email", ProjectClaim: "proj", TagsClaim: "labels"}))
	require.NoError(t, err)
	for _, bad := range []*adminv1.CreateTrustedIssuerRequest{{ProjectClaim: "a..b"}, {TagsClaim: "has space"}} {
		bad.OrgId, bad.Issuer, bad.Audience, bad.TeamClaim = tn.OrgID, is.URL(), "other", "team"
		_, err := issuers.CreateTrustedIssuer(ctx, connect.NewRequest(bad))
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	}
	p := d.StartProxy("default", time.Minute)
	sign := func(extra map[string]any) string {
		extra["team"], extra["email"] = "team", "jwt-labels@example.com"
		return is.Sign(oidctest.Claims{Subject: "s", Audience: "sluice", Extra: extra})
	}
	for _, c := range []struct {
		name, tok, scope string
	}{
		{"project", sign(map[string]any{"proj": "search"}), "project:" + project},
		{"tag", sign(map[string]any{"proj": "other", "labels": []any{"x", "eval"}}), "tag:" + tag},
	} {
		harness.WaitStatus(t, p, c.tok, http.StatusOK, 10*time.Second) // /v1/auth/check: no rpm unit
		e := settingsPost(t, p, c.tok, "", settingsBody)
		require.Equal(t, http.StatusOK, e.status, "%s: %s %s", c.name, e.Error.Code, e.Error.Message)
		e = settingsPost(t, p, c.tok, "", settingsBody)
		require.Equal(t, http.StatusTooManyRequests, e.status, c.name)
		require.Equal(t, c.scope, e.hdr.Get(dataplane.HeaderLimitScope), c.name)
		require.Equal(t, "rpm", e.hdr.Get(dataplane.HeaderLimitType), c.name)
	}
	// Neither project nor tags: no label scope limits it.
	free := sign(map[string]any{})
	for range 2 {
		e := settingsPost(t, p, free, "", settingsBody)
		require.Equal(t, http.StatusOK, e.status, "%s %s", e.Error.Code, e.Error.Message)
	}
	for _, extra := range []map[string]any{{"proj": " search"}, {"labels": []any{"bad tag"}}, {"labels": map[string]any{"a": "b"}}, {"labels": []any{"eval", "eval"}}} {
		status, code := harness.Check(t, p, sign(extra))
		require.Equal(t, http.StatusUnauthorized, status, "%v", extra)
		require.Equal(t, "invalid_token", code, "%v", extra)
	}
}
