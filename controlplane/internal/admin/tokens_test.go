package admin

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// mint creates an admin token with tok and returns it and its record.
func (b *bundle) mint(tok string, req *adminv1.CreateAdminTokenRequest) (string, *adminv1.AdminToken, error) {
	b.t.Helper()
	if req.Name == "" {
		req.Name = "child"
	}
	resp, err := b.as(tok).Token.CreateAdminToken(context.Background(), connect.NewRequest(req))
	if err != nil {
		return "", nil, err
	}
	return resp.Msg.Token, resp.Msg.AdminToken, nil
}

// whoAmI returns tok's WhoAmI, or the error.
func (b *bundle) whoAmI(tok string) (*adminv1.WhoAmIResponse, error) {
	resp, err := b.as(tok).Token.WhoAmI(context.Background(), connect.NewRequest(&adminv1.WhoAmIRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// TestAdminTokenLifetimeIsBoundedByItsIssuer: a minted token never
// outlives the token that minted it. An unset expiry inherits the
// issuer's, a later one is refused; revoking or expiring an issuer ends
// every token below it, transitively. The bootstrap token is the root.
func TestAdminTokenLifetimeIsBoundedByItsIssuer(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("lifetimes")
	team, err := b.root().Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: "t"}))
	require.NoError(t, err)
	now := b.clock.Now()
	orgAdmin := func(exp *timestamppb.Timestamp) *adminv1.CreateAdminTokenRequest {
		return &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_ADMIN, OrgId: org.Id, ExpireTime: exp}
	}

	// The root mints tokens without an expiry, or with any.
	forever, foreverRec, err := b.mint(b.bootstrap, orgAdmin(nil))
	require.NoError(t, err)
	require.Nil(t, foreverRec.ExpireTime)
	a, aRec, err := b.mint(b.bootstrap, orgAdmin(timestamppb.New(now.Add(time.Hour))))
	require.NoError(t, err)
	aExp := aRec.ExpireTime.AsTime()

	// A child of a: no expiry given inherits a's; a later one is refused,
	// naming the field and a's expiry; an earlier one is kept.
	child, childRec, err := b.mint(a, orgAdmin(nil))
	require.NoError(t, err)
	require.NotNil(t, childRec.ExpireTime, "an unset expiry is inherited")
	require.True(t, childRec.ExpireTime.AsTime().Equal(aExp), "%v vs %v", childRec.ExpireTime.AsTime(), aExp)
	before := b.auditCount()
	_, _, err = b.mint(a, orgAdmin(timestamppb.New(now.Add(2*time.Hour))))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "expire_time: must not be after the expiry of the token creating it ("+aExp.Format(time.RFC3339Nano)+")")
	_, _, err = b.mint(a, orgAdmin(timestamppb.New(aExp.Add(time.Microsecond))))
	require.Equal(t, "invalid_argument", codeOf(err), "not even by a microsecond")
	require.Equal(t, before, b.auditCount())
	short, shortRec, err := b.mint(a, orgAdmin(timestamppb.New(now.Add(30*time.Minute))))
	require.NoError(t, err)
	require.True(t, shortRec.ExpireTime.AsTime().Equal(now.Add(30*time.Minute)))

	// A grandchild (team scope, via the child) inherits too, and WhoAmI
	// reports the effective expiry.
	grand, grandRec, err := b.mint(child, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_TEAM, Role: adminv1.Role_ROLE_EDITOR,
		OrgId: org.Id, TeamId: team.Msg.Team.Id})
	require.NoError(t, err)
	require.True(t, grandRec.ExpireTime.AsTime().Equal(aExp))
	who, err := b.whoAmI(grand)
	require.NoError(t, err)
	require.True(t, who.ExpireTime.AsTime().Equal(aExp))

	// A token minted before this rule (no expiry of its own, below a
	// token that has one) still ends with its issuer.
	legacy, legacyRec, err := b.mint(a, orgAdmin(nil))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE admin_tokens SET expires_at = NULL WHERE id = $1`, legacyRec.Id)
	require.NoError(t, err)
	who, err = b.whoAmI(legacy)
	require.NoError(t, err)
	require.True(t, who.ExpireTime.AsTime().Equal(aExp), "effective expiry is the issuer's")

	for _, tok := range []string{a, child, short, grand, legacy, forever} {
		_, err := b.whoAmI(tok)
		require.NoError(t, err)
	}

	// Revoking a middle token ends what it minted, not its issuer or
	// siblings.
	_, err = b.root().Token.RevokeAdminToken(ctx, connect.NewRequest(&adminv1.RevokeAdminTokenRequest{Id: childRec.Id}))
	require.NoError(t, err)
	_, err = b.whoAmI(child)
	require.Equal(t, "unauthenticated", codeOf(err))
	require.Contains(t, err.Error(), "admin token has been revoked")
	_, err = b.whoAmI(grand)
	require.Equal(t, "unauthenticated", codeOf(err), "the grandchild stops with its revoked parent")
	require.Contains(t, err.Error(), "a token it was created with has been revoked")
	for _, tok := range []string{a, short, legacy} {
		_, err := b.whoAmI(tok)
		require.NoError(t, err)
	}

	// The issuer expiring ends every token below it, the legacy one too.
	b.clock.Advance(time.Hour)
	_, err = b.whoAmI(a)
	require.Equal(t, "unauthenticated", codeOf(err))
	require.Contains(t, err.Error(), "admin token has expired")
	_, err = b.whoAmI(legacy)
	require.Equal(t, "unauthenticated", codeOf(err))
	require.Contains(t, err.Error(), "a token it was created with has expired")
	// The root's tokens without an expiry live on.
	_, err = b.whoAmI(forever)
	require.NoError(t, err)

	// Revoking the top of a chain ends it transitively.
	p1, p1Rec, err := b.mint(forever, orgAdmin(nil))
	require.NoError(t, err)
	require.Nil(t, p1Rec.ExpireTime, "an issuer without expiry passes none on")
	p2, _, err := b.mint(p1, orgAdmin(nil))
	require.NoError(t, err)
	p3, _, err := b.mint(p2, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_VIEWER, OrgId: org.Id})
	require.NoError(t, err)
	_, err = b.whoAmI(p3)
	require.NoError(t, err)
	_, err = b.root().Token.RevokeAdminToken(ctx, connect.NewRequest(&adminv1.RevokeAdminTokenRequest{Id: foreverRec.Id}))
	require.NoError(t, err)
	for _, tok := range []string{p1, p2, p3} {
		_, err := b.whoAmI(tok)
		require.Equal(t, "unauthenticated", codeOf(err))
		require.Contains(t, err.Error(), "a token it was created with has been revoked")
	}
}

// TestAdminTokenWithMissingIssuerIsRefused: should an issuer's row be
// gone, its tokens fail closed.
func TestAdminTokenWithMissingIssuerIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	org := b.mkOrg("orphans")
	parent, parentRec, err := b.mint(b.bootstrap, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_ADMIN, OrgId: org.Id})
	require.NoError(t, err)
	child, _, err := b.mint(parent, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_VIEWER, OrgId: org.Id})
	require.NoError(t, err)
	_, err = b.whoAmI(child)
	require.NoError(t, err)
	_, err = b.pool.Exec(context.Background(), `DELETE FROM admin_tokens WHERE id = $1`, parentRec.Id)
	require.NoError(t, err)
	_, err = b.whoAmI(child)
	require.Equal(t, "unauthenticated", codeOf(err))
	require.Contains(t, err.Error(), "no longer exists")
}

// TestDeleteAdminToken: a deleted admin token is refused at once, and so
// is every token it created; the deletion is audited with the record as it
// was; a token of another org cannot be deleted by an org admin.
func TestDeleteAdminToken(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org, other := b.mkOrg("del-tok"), b.mkOrg("del-tok-other")
	orgAdmin := func(id *string) *adminv1.CreateAdminTokenRequest {
		return &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_ADMIN, OrgId: *id}
	}
	admin, adminRec, err := b.mint(b.bootstrap, orgAdmin(&org.Id))
	require.NoError(t, err)
	child, _, err := b.mint(admin, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_VIEWER, OrgId: org.Id})
	require.NoError(t, err)
	_, otherRec, err := b.mint(b.bootstrap, orgAdmin(&other.Id))
	require.NoError(t, err)
	_, err = b.whoAmI(child)
	require.NoError(t, err)

	_, err = b.as(admin).Token.DeleteAdminToken(ctx, connect.NewRequest(&adminv1.DeleteAdminTokenRequest{Id: otherRec.Id}))
	require.Contains(t, []string{"not_found", "permission_denied"}, codeOf(err), "another org's token")

	audits := b.auditCount()
	_, err = b.root().Token.DeleteAdminToken(ctx, connect.NewRequest(&adminv1.DeleteAdminTokenRequest{Id: adminRec.Id}))
	require.NoError(t, err)
	require.Equal(t, audits+1, b.auditCount())
	for _, tok := range []string{admin, child} {
		_, err := b.whoAmI(tok)
		require.Equal(t, "unauthenticated", codeOf(err))
	}
	_, err = b.root().Token.DeleteAdminToken(ctx, connect.NewRequest(&adminv1.DeleteAdminTokenRequest{Id: adminRec.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = b.root().Token.DeleteAdminToken(ctx, connect.NewRequest(&adminv1.DeleteAdminTokenRequest{}))
	require.Equal(t, "invalid_argument", codeOf(err))
}
