package admin

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/alerts"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

func groupNames(t *testing.T, m interface {
	ListModelGroups(context.Context, *connect.Request[adminv1.ListModelGroupsRequest]) (*connect.Response[adminv1.ListModelGroupsResponse], error)
}) []string {
	t.Helper()
	r, err := m.ListModelGroups(context.Background(), connect.NewRequest(&adminv1.ListModelGroupsRequest{}))
	require.NoError(t, err)
	var out []string
	for _, g := range r.Msg.ModelGroups {
		out = append(out, g.Name)
	}
	return out
}

// TestModelGroupGrants: a new group is visible to no org; a platform-wide
// one to every org; a grant makes a group visible to that org only, and
// its grants to other orgs stay hidden from it. Only platform tokens
// grant and revoke; each is audited and distributed, a revocation as a
// security event.
func TestModelGroupGrants(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	orgA, orgB := b.mkOrg("grant-a"), b.mkOrg("grant-b")
	tokA := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, orgA.Id, "")
	tokB := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, orgB.Id, "")
	root := b.models(b.bootstrap)
	b.mkModelGroup("private")
	_, err := root.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "shared", PlatformWide: true}))
	require.NoError(t, err)

	require.Equal(t, []string{"shared"}, groupNames(t, b.models(tokA)), "a new group is visible to no org")
	_, err = b.models(tokA).GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "private"}))
	require.Equal(t, "not_found", codeOf(err))

	// Org admins cannot grant themselves a group.
	_, err = b.models(tokA).GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "private", OrgId: orgA.Id}))
	require.Equal(t, "permission_denied", codeOf(err))

	audits, outbox := b.auditCount(), b.outboxCount()
	g, err := root.GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "private", OrgId: orgA.Id}))
	require.NoError(t, err)
	require.Equal(t, "bootstrap", g.Msg.Grant.CreatedBy)
	require.Equal(t, audits+1, b.auditCount())
	require.Equal(t, outbox+1, b.outboxCount())
	require.Equal(t, outboxRow{Kind: string(events.ModelGroupGranted), ObjectType: "model_group", ObjectID: "private", Payload: "{}"}, b.lastOutbox())
	a := b.lastAudit()
	require.Equal(t, "granted", a.Action)
	require.Equal(t, "model_group_grant", a.ObjectType)
	require.Equal(t, "private/"+orgA.Id, a.ObjectID)
	require.Equal(t, orgA.Id, a.OrgID)

	_, err = root.GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "private", OrgId: orgA.Id}))
	require.Equal(t, "already_exists", codeOf(err))
	_, err = root.GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "nope", OrgId: orgA.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = root.GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "private", OrgId: "org_nope"}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = root.GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: "private"}))
	require.Equal(t, "invalid_argument", codeOf(err))

	require.Equal(t, []string{"private", "shared"}, groupNames(t, b.models(tokA)))
	require.Equal(t, []string{"shared"}, groupNames(t, b.models(tokB)))
	ga, err := b.models(tokA).GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "private"}))
	require.NoError(t, err)
	require.Empty(t, ga.Msg.ModelGroup.GrantedOrgIds, "org tokens never see the grant list")
	gp, err := root.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: "private"}))
	require.NoError(t, err)
	require.Equal(t, []string{orgA.Id}, gp.Msg.ModelGroup.GrantedOrgIds)

	// Grants of an org: the org's own; another org's are refused.
	lg, err := b.models(tokA).ListModelGroupGrants(ctx, connect.NewRequest(&adminv1.ListModelGroupGrantsRequest{}))
	require.NoError(t, err)
	require.Len(t, lg.Msg.Grants, 1)
	require.Equal(t, orgA.Id, lg.Msg.Grants[0].OrgId)
	lb, err := b.models(tokB).ListModelGroupGrants(ctx, connect.NewRequest(&adminv1.ListModelGroupGrantsRequest{}))
	require.NoError(t, err)
	require.Empty(t, lb.Msg.Grants)
	_, err = b.models(tokB).ListModelGroupGrants(ctx, connect.NewRequest(&adminv1.ListModelGroupGrantsRequest{OrgId: orgA.Id}))
	require.Equal(t, "permission_denied", codeOf(err))

	// Revocation: audited, a security event.
	_, err = root.RevokeModelGroup(ctx, connect.NewRequest(&adminv1.RevokeModelGroupRequest{ModelGroup: "private", OrgId: orgA.Id}))
	require.NoError(t, err)
	last := b.lastOutbox()
	require.Equal(t, string(events.ModelGroupRevoked), last.Kind)
	spec, err := events.Lookup(last.Kind)
	require.NoError(t, err)
	require.True(t, spec.Security([]byte(last.Payload)))
	require.Equal(t, "revoked", b.lastAudit().Action)
	require.Equal(t, []string{"shared"}, groupNames(t, b.models(tokA)))
	_, err = root.RevokeModelGroup(ctx, connect.NewRequest(&adminv1.RevokeModelGroupRequest{ModelGroup: "private", OrgId: orgA.Id}))
	require.Equal(t, "not_found", codeOf(err))

	// Clearing platform_wide is a revocation for every org without a grant.
	_, err = root.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
		ModelGroup: &adminv1.ModelGroup{Name: "shared"}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"platformWide"}}}))
	require.NoError(t, err)
	require.Equal(t, string(events.ModelGroupRevoked), b.lastOutbox().Kind)
	require.Empty(t, groupNames(t, b.models(tokB)))
}

// TestAdminTokenRotation: rotation keeps the record (id, scope, role)
// and gives a new secret; with a grace the old secret works until the
// grace ends, then it is refused; without one it is refused at once.
func TestAdminTokenRotation(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("rotate-tok")
	old, rec, err := b.mint(b.bootstrap, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_ADMIN, OrgId: org.Id})
	require.NoError(t, err)
	child, _, err := b.mint(old, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_VIEWER, OrgId: org.Id})
	require.NoError(t, err)

	_, err = b.root().Token.RotateAdminToken(ctx, connect.NewRequest(&adminv1.RotateAdminTokenRequest{Id: rec.Id, GracePeriod: "2 days"}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "grace_period")

	audits := b.auditCount()
	r, err := b.as(old).Token.RotateAdminToken(ctx, connect.NewRequest(&adminv1.RotateAdminTokenRequest{Id: rec.Id, GracePeriod: "1h"}))
	require.NoError(t, err)
	require.Equal(t, audits+1, b.auditCount())
	require.Contains(t, b.lastAudit().After, `"grace_period":"1h0m0s"`)
	require.NotContains(t, b.lastAudit().After, r.Msg.Token)
	newTok := r.Msg.Token
	require.NotEqual(t, old, newTok)
	require.Equal(t, rec.Id, r.Msg.AdminToken.Id)
	require.Equal(t, b.clock.Now().Add(time.Hour), r.Msg.AdminToken.PreviousValidUntil.AsTime())
	for _, tok := range []string{old, newTok, child} {
		w, err := b.whoAmI(tok)
		require.NoError(t, err)
		require.Contains(t, []string{rec.Id, w.Principal}, w.Principal)
	}
	w, err := b.whoAmI(newTok)
	require.NoError(t, err)
	require.Equal(t, rec.Id, w.Principal, "same record")

	b.clock.Advance(time.Hour)
	_, err = b.whoAmI(old)
	require.Equal(t, "unauthenticated", codeOf(err), "grace over")
	require.Contains(t, err.Error(), "grace period is over")
	_, err = b.whoAmI(newTok)
	require.NoError(t, err)
	_, err = b.whoAmI(child)
	require.NoError(t, err, "tokens it created live on")

	// Without a grace the previous secret stops at once.
	r2, err := b.root().Token.RotateAdminToken(ctx, connect.NewRequest(&adminv1.RotateAdminTokenRequest{Id: rec.Id}))
	require.NoError(t, err)
	_, err = b.whoAmI(newTok)
	require.Equal(t, "unauthenticated", codeOf(err))
	_, err = b.whoAmI(r2.Msg.Token)
	require.NoError(t, err)
	require.Contains(t, b.lastAudit().After, `"grace_period":"0s"`)

	// Another tenant's token is not found; a revoked one cannot be rotated.
	other := b.mkOrg("rotate-other")
	otherTok := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, other.Id, "")
	_, err = b.as(otherTok).Token.RotateAdminToken(ctx, connect.NewRequest(&adminv1.RotateAdminTokenRequest{Id: rec.Id}))
	require.Equal(t, "not_found", codeOf(err))
	_, err = b.root().Token.RevokeAdminToken(ctx, connect.NewRequest(&adminv1.RevokeAdminTokenRequest{Id: rec.Id}))
	require.NoError(t, err)
	_, err = b.root().Token.RotateAdminToken(ctx, connect.NewRequest(&adminv1.RotateAdminTokenRequest{Id: rec.Id}))
	require.Equal(t, "failed_precondition", codeOf(err))
	_, err = b.whoAmI(r2.Msg.Token)
	require.Equal(t, "unauthenticated", codeOf(err), "revoked: refused at once")
}

// TestAdminTokenExpiryUpdate: an expiry set later is enforced from that
// time on; it must be in the future and within the caller's own expiry.
func TestAdminTokenExpiryUpdate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org := b.mkOrg("expiry-tok")
	tok, rec, err := b.mint(b.bootstrap, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_ADMIN, OrgId: org.Id})
	require.NoError(t, err)
	root := b.root().Token
	_, err = root.UpdateAdminTokenExpiry(ctx, connect.NewRequest(&adminv1.UpdateAdminTokenExpiryRequest{Id: rec.Id,
		ExpireTime: timestamppb.New(b.clock.Now().Add(-time.Minute))}))
	require.Equal(t, "invalid_argument", codeOf(err))

	audits := b.auditCount()
	r, err := root.UpdateAdminTokenExpiry(ctx, connect.NewRequest(&adminv1.UpdateAdminTokenExpiryRequest{Id: rec.Id,
		ExpireTime: timestamppb.New(b.clock.Now().Add(10 * time.Minute))}))
	require.NoError(t, err)
	require.Equal(t, audits+1, b.auditCount())
	require.Equal(t, b.clock.Now().Add(10*time.Minute), r.Msg.AdminToken.ExpireTime.AsTime())

	// A caller that expires cannot extend beyond itself or clear an expiry.
	child, childRec, err := b.mint(tok, &adminv1.CreateAdminTokenRequest{Scope: adminv1.Scope_SCOPE_ORG, Role: adminv1.Role_ROLE_VIEWER, OrgId: org.Id})
	require.NoError(t, err)
	_, err = b.as(tok).Token.UpdateAdminTokenExpiry(ctx, connect.NewRequest(&adminv1.UpdateAdminTokenExpiryRequest{Id: childRec.Id,
		ExpireTime: timestamppb.New(b.clock.Now().Add(time.Hour))}))
	require.Equal(t, "invalid_argument", codeOf(err))
	_, err = b.as(tok).Token.UpdateAdminTokenExpiry(ctx, connect.NewRequest(&adminv1.UpdateAdminTokenExpiryRequest{Id: childRec.Id}))
	require.Equal(t, "invalid_argument", codeOf(err))

	_, err = b.whoAmI(tok)
	require.NoError(t, err)
	b.clock.Advance(10 * time.Minute)
	for _, tk := range []string{tok, child} {
		_, err = b.whoAmI(tk)
		require.Equal(t, "unauthenticated", codeOf(err), "expired: refused at once, and what it created")
	}
	// Clearing it (platform) brings the token back.
	_, err = root.UpdateAdminTokenExpiry(ctx, connect.NewRequest(&adminv1.UpdateAdminTokenExpiryRequest{Id: rec.Id}))
	require.NoError(t, err)
	_, err = b.whoAmI(tok)
	require.NoError(t, err)
}

// TestAlertWebhooksAPI: org editors manage their org's webhooks; the
// secret is returned once and stored sealed; team tokens and other orgs
// reach none.
func TestAlertWebhooksAPI(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	org, other := b.mkOrg("hooks"), b.mkOrg("hooks-other")
	team, err := b.root().Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: "t"}))
	require.NoError(t, err)
	editor := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_EDITOR, org.Id, "")
	teamTok := b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, org.Id, team.Msg.Team.Id)
	otherTok := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, other.Id, "")

	r, err := b.alertClient(editor).CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{Url: "https://hooks.example.com/a"}))
	require.NoError(t, err)
	require.Equal(t, org.Id, r.Msg.Webhook.OrgId, "defaults to the caller's org")
	_, err = alerts.SecretKey(r.Msg.Secret)
	require.NoError(t, err)
	var sealed []byte
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT secret_ciphertext FROM alert_webhooks WHERE id = $1`, r.Msg.Webhook.Id).Scan(&sealed))
	require.NotContains(t, string(sealed), strings.TrimPrefix(r.Msg.Secret, alerts.SecretPrefix), "stored sealed")
	require.NotContains(t, b.lastAudit().After, r.Msg.Secret)

	for _, bad := range []string{"", "ftp://x/y", "https://user:pw@x/y", "https:///nohost", "https://x/y#frag"} {
		_, err = b.alertClient(editor).CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{Url: bad}))
		require.Equal(t, "invalid_argument", codeOf(err), bad)
		require.Contains(t, err.Error(), "url", bad)
	}
	_, err = b.alertClient(b.bootstrap).CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{Url: "https://x/y"}))
	require.Equal(t, "invalid_argument", codeOf(err), "platform tokens name the org")
	_, err = b.alertClient(teamTok).CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{Url: "https://x/y"}))
	require.Equal(t, "permission_denied", codeOf(err))
	_, err = b.alertClient(otherTok).CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{OrgId: org.Id, Url: "https://x/y"}))
	require.Equal(t, "permission_denied", codeOf(err))

	l, err := b.alertClient(otherTok).ListAlertWebhooks(ctx, connect.NewRequest(&adminv1.ListAlertWebhooksRequest{}))
	require.NoError(t, err)
	require.Empty(t, l.Msg.Webhooks)
	_, err = b.alertClient(otherTok).DeleteAlertWebhook(ctx, connect.NewRequest(&adminv1.DeleteAlertWebhookRequest{Id: r.Msg.Webhook.Id}))
	require.Equal(t, "not_found", codeOf(err))
	l, err = b.alertClient(editor).ListAlertWebhooks(ctx, connect.NewRequest(&adminv1.ListAlertWebhooksRequest{}))
	require.NoError(t, err)
	require.Len(t, l.Msg.Webhooks, 1)

	_, err = b.alertClient(editor).ListAlertDeliveries(ctx, connect.NewRequest(&adminv1.ListAlertDeliveriesRequest{State: "lost"}))
	require.Equal(t, "invalid_argument", codeOf(err))
	require.Contains(t, err.Error(), "state")

	_, err = b.alertClient(editor).DeleteAlertWebhook(ctx, connect.NewRequest(&adminv1.DeleteAlertWebhookRequest{Id: r.Msg.Webhook.Id}))
	require.NoError(t, err)
	l, err = b.alertClient(editor).ListAlertWebhooks(ctx, connect.NewRequest(&adminv1.ListAlertWebhooksRequest{}))
	require.NoError(t, err)
	require.Empty(t, l.Msg.Webhooks)
}
