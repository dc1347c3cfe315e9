package system

import (
	"context"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

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
