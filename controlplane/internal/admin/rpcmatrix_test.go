package admin

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// This file holds the test that every admin RPC audits and authorises.
// It enumerates the RPCs from the generated descriptors, so an RPC added
// without a request builder here fails the test, and one added without
// audit or authorisation fails the checks.

// rpc is one admin RPC.
type rpc struct {
	procedure string // "/sluice.admin.v1.OrgService/CreateOrg"
	method    string // "CreateOrg"
	mutating  bool   // not marked idempotency_level = NO_SIDE_EFFECTS
}

func adminRPCs(t *testing.T) []rpc {
	t.Helper()
	var out []rpc
	protoregistry.GlobalFiles.RangeFilesByPackage("sluice.admin.v1", func(fd protoreflect.FileDescriptor) bool {
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			for j := 0; j < sd.Methods().Len(); j++ {
				md := sd.Methods().Get(j)
				opts, _ := md.Options().(*descriptorpb.MethodOptions)
				readOnly := opts.GetIdempotencyLevel() == descriptorpb.MethodOptions_NO_SIDE_EFFECTS
				out = append(out, rpc{
					procedure: fmt.Sprintf("/%s/%s", sd.FullName(), md.Name()),
					method:    string(md.Name()),
					mutating:  !readOnly,
				})
			}
		}
		return true
	})
	sort.Slice(out, func(i, j int) bool { return out[i].procedure < out[j].procedure })
	require.GreaterOrEqual(t, len(out), 45, "expected every admin RPC in the registry")
	return out
}

// objs names the objects an RPC is aimed at: one team's view of an org.
type objs struct {
	OrgID, TeamID, UserID, CustomerID, KeyID, TokenID string
	IssuerID                                          string
	// LabelScopeID is a project scope of the org.
	LabelScopeID                        string
	EmptyTeamID, FreeUserID, EmptyOrgID string
	// WebhookID is an alert webhook of the org, DeliveryID a dead
	// delivery to it.
	WebhookID, DeliveryID string
	// Platform objects every token may read (not tenant data, so not in
	// ids()): a model group with a deployment, and an empty one.
	ModelGroup, EmptyModelGroup, DeploymentID string
}

var uniq atomic.Int64

func u() string { return fmt.Sprintf("%d", uniq.Add(1)) }

// builders make a valid JSON request for each RPC aimed at o's objects.
var builders = map[string]func(o objs) string{
	"CreateOrg": func(o objs) string { return `{"name":"org-` + u() + `"}` },
	"GetOrg":    func(o objs) string { return `{"id":"` + o.OrgID + `"}` },
	"ListOrgs":  func(o objs) string { return `{}` },
	"UpdateOrg": func(o objs) string {
		return `{"org":{"id":"` + o.OrgID + `","metadata":{"k":"v"}},"update_mask":"metadata"}`
	},
	"DeleteOrg":  func(o objs) string { return `{"id":"` + o.EmptyOrgID + `"}` },
	"BlockOrg":   func(o objs) string { return `{"id":"` + o.OrgID + `"}` },
	"UnblockOrg": func(o objs) string { return `{"id":"` + o.OrgID + `"}` },

	"CreateTeam": func(o objs) string { return `{"org_id":"` + o.OrgID + `","name":"team-` + u() + `"}` },
	"GetTeam":    func(o objs) string { return `{"id":"` + o.TeamID + `"}` },
	"ListTeams":  func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"UpdateTeam": func(o objs) string {
		return `{"team":{"id":"` + o.TeamID + `","metadata":{"k":"v"}},"update_mask":"metadata"}`
	},
	"DeleteTeam":  func(o objs) string { return `{"id":"` + o.EmptyTeamID + `"}` },
	"BlockTeam":   func(o objs) string { return `{"id":"` + o.TeamID + `"}` },
	"UnblockTeam": func(o objs) string { return `{"id":"` + o.TeamID + `"}` },
	"AddTeamMember": func(o objs) string {
		return `{"team_id":"` + o.TeamID + `","user_id":"` + o.FreeUserID + `"}`
	},
	"UpdateTeamMember": func(o objs) string {
		return `{"member":{"team_id":"` + o.TeamID + `","user_id":"` + o.UserID + `","limits":{"rpm_limit":5}},"update_mask":"limits.rpmLimit"}`
	},
	"RemoveTeamMember": func(o objs) string { return `{"team_id":"` + o.TeamID + `","user_id":"` + o.UserID + `"}` },
	"ListTeamMembers":  func(o objs) string { return `{"team_id":"` + o.TeamID + `"}` },

	"CreateUser": func(o objs) string { return `{"org_id":"` + o.OrgID + `","email":"u` + u() + `@example.com"}` },
	"GetUser":    func(o objs) string { return `{"id":"` + o.UserID + `"}` },
	"ListUsers":  func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"UpdateUser": func(o objs) string {
		return `{"user":{"id":"` + o.UserID + `","display_name":"X"},"update_mask":"displayName"}`
	},
	"DeleteUser":  func(o objs) string { return `{"id":"` + o.FreeUserID + `"}` },
	"BlockUser":   func(o objs) string { return `{"id":"` + o.UserID + `"}` },
	"UnblockUser": func(o objs) string { return `{"id":"` + o.UserID + `"}` },

	"CreateKey": func(o objs) string {
		return `{"org_id":"` + o.OrgID + `","team_id":"` + o.TeamID + `","alias":"k` + u() + `"}`
	},
	"GetKey":     func(o objs) string { return `{"id":"` + o.KeyID + `"}` },
	"ListKeys":   func(o objs) string { return `{"org_id":"` + o.OrgID + `","team_id":"` + o.TeamID + `"}` },
	"UpdateKey":  func(o objs) string { return `{"key":{"id":"` + o.KeyID + `","alias":"z"},"update_mask":"alias"}` },
	"DeleteKey":  func(o objs) string { return `{"id":"` + o.KeyID + `"}` },
	"RotateKey":  func(o objs) string { return `{"id":"` + o.KeyID + `","grace_period":"1h"}` },
	"BlockKey":   func(o objs) string { return `{"id":"` + o.KeyID + `"}` },
	"UnblockKey": func(o objs) string { return `{"id":"` + o.KeyID + `"}` },

	"CreateCustomer": func(o objs) string { return `{"org_id":"` + o.OrgID + `","external_id":"c` + u() + `"}` },
	"GetCustomer":    func(o objs) string { return `{"id":"` + o.CustomerID + `"}` },
	"ListCustomers":  func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"UpdateCustomer": func(o objs) string {
		return `{"customer":{"id":"` + o.CustomerID + `","display_name":"X"},"update_mask":"displayName"}`
	},
	"DeleteCustomer": func(o objs) string { return `{"id":"` + o.CustomerID + `"}` },

	"CreateTrustedIssuer": func(o objs) string {
		return `{"org_id":"` + o.OrgID + `","issuer":"https://idp.example.com","audience":"a` + u() + `","team_claim":"team"}`
	},
	"GetTrustedIssuer":    func(o objs) string { return `{"id":"` + o.IssuerID + `"}` },
	"ListTrustedIssuers":  func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"DeleteTrustedIssuer": func(o objs) string { return `{"id":"` + o.IssuerID + `"}` },
	"CreateLabelScope": func(o objs) string {
		return `{"org_id":"` + o.OrgID + `","kind":"LABEL_SCOPE_KIND_TAG","name":"t` + u() + `","limits":{"rpm_limit":5}}`
	},
	"GetLabelScope":   func(o objs) string { return `{"id":"` + o.LabelScopeID + `"}` },
	"ListLabelScopes": func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"UpdateLabelScope": func(o objs) string {
		return `{"label_scope":{"id":"` + o.LabelScopeID + `","limits":{"rpm_limit":7}},"update_mask":"limits.rpmLimit"}`
	},
	"DeleteLabelScope": func(o objs) string { return `{"id":"` + o.LabelScopeID + `"}` },
	"BlockCustomer":    func(o objs) string { return `{"id":"` + o.CustomerID + `"}` },
	"UnblockCustomer":  func(o objs) string { return `{"id":"` + o.CustomerID + `"}` },

	"CreateAdminToken": func(o objs) string {
		return `{"name":"t` + u() + `","scope":"SCOPE_TEAM","org_id":"` + o.OrgID + `","team_id":"` + o.TeamID + `","role":"ROLE_VIEWER"}`
	},
	"ListAdminTokens":  func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"RevokeAdminToken": func(o objs) string { return `{"id":"` + o.TokenID + `"}` },
	"DeleteAdminToken": func(o objs) string { return `{"id":"` + o.TokenID + `"}` },
	"WhoAmI":           func(o objs) string { return `{}` },
	"RotateAdminToken": func(o objs) string { return `{"id":"` + o.TokenID + `","grace_period":"1h"}` },
	"UpdateAdminTokenExpiry": func(o objs) string {
		return `{"id":"` + o.TokenID + `","expire_time":"2030-01-01T00:00:00Z"}`
	},

	"ListAuditEvents":  func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"VerifyAuditChain": func(o objs) string { return `{}` },

	// Fleet and rollout are platform-wide; mkFixture leaves region
	// "default" at version 2 of the compiled versions 1-3.
	"ListDataPlanes":   func(o objs) string { return `{}` },
	"GetRolloutStatus": func(o objs) string { return `{}` },
	"UpsertRegion":     func(o objs) string { return `{"name":"region-` + u() + `","policy":"ROLLOUT_POLICY_STAGED"}` },
	"PromoteVersion":   func(o objs) string { return `{"region":"default","version":3}` },
	"RollbackRegion":   func(o objs) string { return `{"region":"default","version":1}` },

	"GetSpend":      func(o objs) string { return `{"scope":"SPEND_SCOPE_TEAM","id":"` + o.TeamID + `"}` },
	"ListSpendLogs": func(o objs) string { return `{"org_id":"` + o.OrgID + `","team_id":"` + o.TeamID + `"}` },
	"ListAlerts":    func(o objs) string { return `{"org_id":"` + o.OrgID + `","team_id":"` + o.TeamID + `"}` },
	"CreateAlertWebhook": func(o objs) string {
		return `{"org_id":"` + o.OrgID + `","url":"https://hooks.example.com/` + u() + `"}`
	},
	"ListAlertWebhooks":        func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"DeleteAlertWebhook":       func(o objs) string { return `{"id":"` + o.WebhookID + `"}` },
	"RotateAlertWebhookSecret": func(o objs) string { return `{"id":"` + o.WebhookID + `","grace_period":"1h"}` },
	"ListAlertDeliveries":      func(o objs) string { return `{"org_id":"` + o.OrgID + `","state":"dead"}` },
	"RetryAlertDelivery":       func(o objs) string { return `{"delivery_id":"` + o.DeliveryID + `"}` },

	"CreateModelGroup": func(o objs) string {
		return `{"name":"mg-` + u() + `","description":"d","routing":{"strategy":"affinity","session_ttl":"1800s","load_factor":1.5}}`
	},
	"GetModelGroup":   func(o objs) string { return `{"name":"` + o.ModelGroup + `"}` },
	"ListModelGroups": func(o objs) string { return `{}` },
	"UpdateModelGroup": func(o objs) string {
		return `{"model_group":{"name":"` + o.ModelGroup + `","description":"x"},"update_mask":"description"}`
	},
	"DeleteModelGroup": func(o objs) string { return `{"name":"` + o.EmptyModelGroup + `"}` },
	"CreateDeployment": func(o objs) string {
		return `{"model_group":"` + o.ModelGroup + `","api_base":"http://vllm-` + u() + `:8000/v1","upstream_model":"m","credential":"sk-x","prices":{"input_per_token":1e-6}}`
	},
	"GetDeployment":   func(o objs) string { return `{"id":"` + o.DeploymentID + `"}` },
	"ListDeployments": func(o objs) string { return `{"model_group":"` + o.ModelGroup + `"}` },
	"UpdateDeployment": func(o objs) string {
		return `{"deployment":{"id":"` + o.DeploymentID + `","weight":5},"update_mask":"weight"}`
	},
	"DeleteDeployment": func(o objs) string { return `{"id":"` + o.DeploymentID + `"}` },
	"Explain": func(o objs) string {
		return `{"region":"default","query":{"key_id":"` + o.KeyID + `","model":"` + o.ModelGroup + `"}}`
	},
	"GrantModelGroup":  func(o objs) string { return `{"model_group":"` + o.EmptyModelGroup + `","org_id":"` + o.OrgID + `"}` },
	"RevokeModelGroup": func(o objs) string { return `{"model_group":"` + o.ModelGroup + `","org_id":"` + o.OrgID + `"}` },
	"ListModelGroupGrants": func(o objs) string {
		return `{"model_group":"` + o.ModelGroup + `","org_id":"` + o.OrgID + `"}`
	},
	"GetOrgTraffic": func(o objs) string { return `{"org_id":"` + o.OrgID + `"}` },
	"SetOrgTraffic": func(o objs) string {
		return `{"org_id":"` + o.OrgID + `","traffic":{"rules":[{"header":"User-Agent","pattern":"^claude-code/","traffic_class":"TRAFFIC_CLASS_AGENT"}]}}`
	},
	"GetDeploymentTraffic": func(o objs) string { return `{"deployment_id":"` + o.DeploymentID + `"}` },
	"SetDeploymentTraffic": func(o objs) string {
		return `{"deployment_id":"` + o.DeploymentID + `","traffic":{"priority_scheduling":true}}`
	},
	"GetModelGroupTraffic": func(o objs) string { return `{"model_group":"` + o.ModelGroup + `"}` },
	"SetModelGroupTraffic": func(o objs) string {
		return `{"model_group":"` + o.ModelGroup + `","traffic":{"queues":[{"traffic_class":"TRAFFIC_CLASS_AGENT","max_length":10}]}}`
	},
}

// orgFixture is one org with two teams, each with a member, a key and a
// team-scoped token, plus objects free for deletion and membership.
type orgFixture struct {
	team1, team2 objs
}

func (b *bundle) mkFixture(name string) orgFixture {
	b.t.Helper()
	ctx := context.Background()
	c := b.root()
	must := func(err error) {
		b.t.Helper()
		require.NoError(b.t, err)
	}
	org := b.mkOrg(name + "-" + u())
	empty := b.mkOrg(name + "-empty-" + u())
	mkTeam := func(n string) string {
		r, err := c.Team.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: org.Id, Name: n}))
		must(err)
		return r.Msg.Team.Id
	}
	mkUser := func() string {
		r, err := c.User.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: org.Id, Email: "u" + u() + "@example.com"}))
		must(err)
		return r.Msg.User.Id
	}
	cus, err := c.Customer.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: org.Id, ExternalId: "cust-" + u()}))
	must(err)
	lsc, err := c.LabelScope.CreateLabelScope(ctx, connect.NewRequest(&adminv1.CreateLabelScopeRequest{OrgId: org.Id,
		Kind: adminv1.LabelScopeKind_LABEL_SCOPE_KIND_PROJECT, Name: "proj-" + u(), Limits: &adminv1.Limits{MaxParallelRequests: proto.Int64(2)}}))
	must(err)
	iss, err := c.Issuer.CreateTrustedIssuer(ctx, connect.NewRequest(&adminv1.CreateTrustedIssuerRequest{OrgId: org.Id,
		Issuer: "https://idp.example.com", Audience: "fixture-" + u(), TeamClaim: "team"}))
	must(err)
	for v := uint64(1); v <= 3; v++ {
		b.mkConfigVersion(v, "default")
	}
	_, err = b.pool.Exec(ctx, `UPDATE regions SET current_version = 2, rollback = false WHERE name = 'default'`)
	must(err)
	emptyTeam := mkTeam("empty")
	freeUser := mkUser()
	group, emptyGroup := b.mkModelGroup("fixture-"+u()), b.mkModelGroup("fixture-empty-"+u())
	dep := b.mkDeployment(group, "")
	_, err = b.models(b.bootstrap).GrantModelGroup(ctx, connect.NewRequest(&adminv1.GrantModelGroupRequest{ModelGroup: group, OrgId: org.Id}))
	must(err)
	wh, err := b.alertClient(b.bootstrap).CreateAlertWebhook(ctx, connect.NewRequest(&adminv1.CreateAlertWebhookRequest{
		OrgId: org.Id, Url: "http://127.0.0.1:9/fixture"}))
	must(err)
	delivery := b.mkDeadDelivery(org.Id, wh.Msg.Webhook.Id)
	view := func(teamName string) objs {
		team := mkTeam(teamName)
		user := mkUser()
		_, err := c.Team.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: team, UserId: user}))
		must(err)
		k, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: org.Id, TeamId: team, UserId: user, Alias: "fixture"}))
		must(err)
		tk, err := c.Token.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{
			Name: "fixture", Scope: adminv1.Scope_SCOPE_TEAM, OrgId: org.Id, TeamId: team, Role: adminv1.Role_ROLE_VIEWER,
		}))
		must(err)
		return objs{OrgID: org.Id, TeamID: team, UserID: user, CustomerID: cus.Msg.Customer.Id, KeyID: k.Msg.Key.Id, IssuerID: iss.Msg.Issuer.Id, LabelScopeID: lsc.Msg.LabelScope.Id,
			TokenID: tk.Msg.AdminToken.Id, EmptyTeamID: emptyTeam, FreeUserID: freeUser, EmptyOrgID: empty.Id,
			ModelGroup: group, EmptyModelGroup: emptyGroup, DeploymentID: dep.Id, WebhookID: wh.Msg.Webhook.Id, DeliveryID: delivery}
	}
	return orgFixture{team1: view("one"), team2: view("two")}
}

func (o objs) ids() []string {
	return []string{o.OrgID, o.TeamID, o.UserID, o.CustomerID, o.KeyID, o.TokenID, o.EmptyTeamID, o.FreeUserID, o.EmptyOrgID, o.IssuerID,
		o.WebhookID, o.DeliveryID, o.LabelScopeID}
}

func TestEveryMutatingRPCWritesExactlyOneAuditRow(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, r := range adminRPCs(t) {
		build := builders[r.method]
		if build == nil {
			t.Errorf("%s: no request builder in rpcmatrix_test.go; add one so the RPC is checked for audit and authorisation", r.procedure)
			continue
		}
		if !r.mutating {
			continue
		}
		fx := b.mkFixture("audit")
		body := build(fx.team1)
		if strings.HasPrefix(r.method, "Unblock") {
			// Unblock something that is blocked.
			block := strings.Replace(r.procedure, "/Unblock", "/Block", 1)
			code, out := b.callJSON(b.bootstrap, block, body)
			require.Equal(t, "ok", code, "%s: %s", block, out)
		}
		before := b.auditCount()
		code, out := b.callJSON(b.bootstrap, r.procedure, body)
		require.Equal(t, "ok", code, "%s as platform admin: %s", r.procedure, out)
		require.Equal(t, before+1, b.auditCount(), "%s must write exactly one audit row", r.procedure)
	}
	resp, err := b.root().Audit.VerifyAuditChain(context.Background(), connect.NewRequest(&adminv1.VerifyAuditChainRequest{}))
	require.NoError(t, err)
	require.True(t, resp.Msg.Ok, "chain must verify: %s", resp.Msg.Problem)
}

// checkIsolated calls every RPC aimed at target's objects with tok and
// requires PermissionDenied or NotFound, or, for reads that succeed, an
// answer that names none of the forbidden ids. Nothing may be audited.
func checkIsolated(t *testing.T, b *bundle, tok string, target objs, forbidden []string, who string) {
	t.Helper()
	before := b.auditCount()
	for _, r := range adminRPCs(t) {
		build := builders[r.method]
		if build == nil {
			t.Errorf("%s: no request builder", r.procedure)
			continue
		}
		code, out := b.callJSON(tok, r.procedure, build(target))
		switch code {
		case "permission_denied", "not_found":
			continue
		case "ok":
			if r.mutating {
				t.Errorf("%s: %s changed another tenant's objects: %s", r.procedure, who, out)
				continue
			}
			for _, id := range forbidden {
				if id != "" && strings.Contains(string(out), id) {
					t.Errorf("%s: %s read %s: %s", r.procedure, who, id, out)
				}
			}
		default:
			t.Errorf("%s: %s got %s, want permission_denied or not_found: %s", r.procedure, who, code, out)
		}
	}
	require.Equal(t, before, b.auditCount(), "%s: refused calls must not write audit rows", who)
}

func TestOrgTokenCannotReachAnotherOrg(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.mkFixture("a")
	other := b.mkFixture("b")
	tokB := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_ADMIN, other.team1.OrgID, "")
	checkIsolated(t, b, tokB, a.team1, append(a.team1.ids(), a.team2.ids()...), "org B admin")
}

func TestViewerCannotMutate(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.mkFixture("a")
	for _, scope := range []struct {
		name string
		tok  string
	}{
		{"platform viewer", b.mkToken(adminv1.Scope_SCOPE_PLATFORM, adminv1.Role_ROLE_VIEWER, "", "")},
		{"org viewer", b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, a.team1.OrgID, "")},
		{"team viewer", b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, a.team1.OrgID, a.team1.TeamID)},
	} {
		before := b.auditCount()
		for _, r := range adminRPCs(t) {
			if !r.mutating {
				continue
			}
			code, out := b.callJSON(scope.tok, r.procedure, builders[r.method](a.team1))
			if code != "permission_denied" {
				t.Errorf("%s: %s got %s, want permission_denied: %s", r.procedure, scope.name, code, out)
			}
		}
		require.Equal(t, before, b.auditCount(), "%s: nothing audited", scope.name)
	}
}

func TestTeamTokenStaysInItsTeam(t *testing.T) {
	t.Parallel()
	b := setup(t)
	a := b.mkFixture("a")
	tok := b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_ADMIN, a.team1.OrgID, a.team1.TeamID)
	// Aimed at the other team of the same org (and at org-level objects).
	t2 := a.team2
	forbidden := []string{t2.TeamID, t2.UserID, t2.KeyID, t2.TokenID, t2.EmptyTeamID, t2.FreeUserID, t2.EmptyOrgID, t2.CustomerID, t2.IssuerID,
		t2.WebhookID, t2.DeliveryID, t2.LabelScopeID}
	checkIsolated(t, b, tok, t2, forbidden, "team-one admin")

	// Positive control: inside its own team the same token works.
	for _, m := range []string{"/sluice.admin.v1.KeyService/UpdateKey", "/sluice.admin.v1.KeyService/RotateKey", "/sluice.admin.v1.TeamService/GetTeam", "/sluice.admin.v1.TeamService/ListTeamMembers"} {
		parts := strings.Split(m, "/")
		code, out := b.callJSON(tok, m, builders[parts[len(parts)-1]](a.team1))
		require.Equal(t, "ok", code, "%s in own team: %s", m, out)
	}
}

// mkDeadDelivery records an alert of org and a dead delivery of it to
// webhook (as the deliverer leaves one after its last attempt), returning
// the delivery id.
func (b *bundle) mkDeadDelivery(org, webhook string) string {
	b.t.Helper()
	ctx := context.Background()
	alertID := org + "/key/k/30d/0/" + u()
	_, err := b.pool.Exec(ctx, `INSERT INTO budget_alerts (alert_id, fired_at, org_id, scope_kind, scope_id, threshold_percent,
		spend_micros, cap_micros, soft_micros, budget_duration, window_start) VALUES ($1, now(), $2, 'key', 'k', 100, 1, 1, 0, '30d', now())`,
		alertID, org)
	require.NoError(b.t, err)
	id := "dlv_fixture_" + u()
	_, err = b.pool.Exec(ctx, `INSERT INTO alert_deliveries (delivery_id, alert_id, webhook_id, org_id, state, attempts, next_attempt_at,
		last_error, created_at) VALUES ($1, $2, $3, $4, 'dead', 12, now(), 'HTTP 500', now())`, id, alertID, webhook, org)
	require.NoError(b.t, err)
	return id
}
