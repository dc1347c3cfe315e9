package system

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
)

func (d *dist) explainClient(tok string) adminv1connect.ExplainServiceClient {
	return adminv1connect.NewExplainServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(tok)))
}

// explainCase is one request: how it is explained and what is sent.
type explainCase struct {
	name    string
	cred    func(q *configv1.ExplainQuery) // sets the credential of the query
	token   string                         // the bearer the real request sends
	headers map[string]string
	body    string
	// shape, when set, is explained instead of body (body is then the
	// same request written out by the test).
	shape *configv1.ExplainQuery
}

// TestExplainAgreesWithTheProxy explains 20 varied requests through the
// admin API (control plane → NATS → a data plane's dry run) and then
// sends each to that data plane: the explained status and error code are
// the proxy's answer, the class is the one the proxy announces, and the
// model group and deployment are those of the request's ledger row (the
// usage event), the deployment among the explained candidates (first
// when the choice is not a random draw). Explaining consumes nothing:
// a key allowed one request a minute is explained twice and still gets
// its request. Tenant isolation is checked on the real data plane: an
// org token cannot explain another org's key or token.
func TestExplainAgreesWithTheProxy(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	sims := []*vllmsim.Server{startSim(t), startSim(t), startSim(t)}
	m := d.modelClient()
	for _, g := range []string{"chat", "small"} {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: g, PlatformWide: true}))
		require.NoError(t, err)
	}
	mkDep := func(group string, sim *vllmsim.Server, caps *adminv1.Capabilities, tags ...string) string {
		r, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: group, ApiBase: sim.URL() + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
			Capabilities: caps, Tags: tags, Prices: fastPrices}))
		require.NoError(t, err)
		return r.Msg.Deployment.Id
	}
	depA := mkDep("chat", sims[0], &adminv1.Capabilities{Tools: true})
	depB := mkDep("chat", sims[1], &adminv1.Capabilities{})
	depGold := mkDep("chat", sims[2], &adminv1.Capabilities{Tools: true}, "gold")
	depSmall := mkDep("small", sims[0], &adminv1.Capabilities{MaxInputTokens: 50, MaxOutputTokens: 64})

	c := d.Clients()
	ten := d.NewTenant("explain")
	other := d.NewTenant("explain-other")
	i64 := func(v int64) *int64 { return &v }
	key := func(req *adminv1.CreateKeyRequest) (string, string) {
		req.OrgId, req.TeamId = ten.OrgID, ten.TeamID
		r, err := c.Key.CreateKey(ctx, connect.NewRequest(req))
		require.NoError(t, err)
		return r.Msg.Key.Id, r.Msg.Token
	}
	goldID, goldTok := key(&adminv1.CreateKeyRequest{Tags: []string{"gold"}})
	batchID, batchTok := key(&adminv1.CreateKeyRequest{TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_BATCH})
	rpmID, rpmTok := key(&adminv1.CreateKeyRequest{Limits: &adminv1.Limits{RpmLimit: i64(1)}})
	tpmID, tpmTok := key(&adminv1.CreateKeyRequest{Limits: &adminv1.Limits{TpmLimit: i64(60)}})
	smallOnlyID, smallOnlyTok := key(&adminv1.CreateKeyRequest{Limits: &adminv1.Limits{AllowedModels: []string{"small"}}})
	aliasID, aliasTok := key(&adminv1.CreateKeyRequest{ModelGroupAliases: map[string]string{"mini": "small"}})
	blockedID, blockedTok := key(&adminv1.CreateKeyRequest{})
	_, err := c.Key.BlockKey(ctx, connect.NewRequest(&adminv1.BlockKeyRequest{Id: blockedID}))
	require.NoError(t, err)
	teams := adminv1connect.NewTeamServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	aliasTeam, err := teams.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: ten.OrgID, Name: "aliased",
		ModelGroupAliases: map[string]string{"gpt-4o": "chat"}, TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT}))
	require.NoError(t, err)
	tk, err := c.Key.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: aliasTeam.Msg.Team.Id}))
	require.NoError(t, err)
	teamKeyID, teamKeyTok := tk.Msg.Key.Id, tk.Msg.Token
	cust := d.customerClient()
	cu, err := cust.CreateCustomer(ctx, connect.NewRequest(&adminv1.CreateCustomerRequest{OrgId: ten.OrgID, ExternalId: "acme"}))
	require.NoError(t, err)
	_, err = cust.BlockCustomer(ctx, connect.NewRequest(&adminv1.BlockCustomerRequest{Id: cu.Msg.Customer.Id}))
	require.NoError(t, err)
	traffic := adminv1connect.NewTrafficServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	_, err = traffic.SetOrgTraffic(ctx, connect.NewRequest(&adminv1.SetOrgTrafficRequest{OrgId: ten.OrgID, Traffic: &adminv1.OrgTraffic{
		Rules: []*adminv1.ClassificationRule{{Header: "User-Agent", Pattern: "^agent-bot/", TrafficClass: adminv1.TrafficClass_TRAFFIC_CLASS_AGENT}}}}))
	require.NoError(t, err)

	p := d.StartProxy("default", time.Minute)
	harness.Eventually(t, func() bool {
		cat := p.DP.Catalog()
		return len(cat.Deployments("chat")) == 3 && len(cat.Deployments("small")) == 1
	}, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)
	harness.WaitStatus(t, p, blockedTok, http.StatusForbidden, 10*time.Second)
	harness.WaitStatus(t, p, teamKeyTok, http.StatusOK, 10*time.Second)
	// The org's rules and the blocked customer arrive with the same
	// stream; wait for the rule to apply before explaining anything.
	ex := d.explainClient(testBootstrap)
	harness.Eventually(t, func() bool {
		r, err := ex.Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: &configv1.ExplainQuery{KeyId: ten.KeyID, Model: "chat",
			Headers: map[string]string{"User-Agent": "agent-bot/1", dataplane.HeaderEndUser: "acme"}}}))
		return err == nil && r.Msg.GetTrace().GetOutcome().GetErrorCode() == dataplane.CodeCustomerBlocked
	}, 10*time.Second, 50*time.Millisecond, "the org's traffic settings and customers never reached the data plane")

	byID := func(id string) func(q *configv1.ExplainQuery) { return func(q *configv1.ExplainQuery) { q.KeyId = id } }
	byToken := func(tok string) func(q *configv1.ExplainQuery) {
		return func(q *configv1.ExplainQuery) { q.Token = tok }
	}
	chat := func(model, extra string) string {
		return `{"model":"` + model + `","messages":[{"role":"user","content":"Say hello to the explainer."}],"max_tokens":8` + extra + `}`
	}
	tools := `,"tools":[{"type":"function","function":{"name":"lookup","parameters":{"type":"object"}}}]`
	long := `{"model":"small","messages":[{"role":"user","content":"` + strings.Repeat("long prompt ", 60) + `"}],"max_tokens":8}`
	cases := []explainCase{
		{name: "plain key by id", cred: byID(ten.KeyID), token: ten.Token, body: chat("chat", "")},
		{name: "plain key by token", cred: byToken(ten.Token), token: ten.Token, body: chat("chat", "")},
		{name: "stream", cred: byID(ten.KeyID), token: ten.Token, body: chat("chat", `,"stream":true`)},
		{name: "tools need a tool-calling deployment", cred: byID(ten.KeyID), token: ten.Token, body: chat("chat", tools)},
		{name: "tag pool", cred: byID(goldID), token: goldTok, body: chat("chat", "")},
		{name: "tag pool with tools", cred: byToken(goldTok), token: goldTok, body: chat("chat", tools)},
		{name: "batch key", cred: byID(batchID), token: batchTok, body: chat("chat", "")},
		{name: "classification rule", cred: byID(ten.KeyID), token: ten.Token, headers: map[string]string{"User-Agent": "agent-bot/2.0"}, body: chat("chat", "")},
		{name: "team alias and team class", cred: byID(teamKeyID), token: teamKeyTok, body: chat("gpt-4o", "")},
		{name: "key alias", cred: byID(aliasID), token: aliasTok, body: chat("mini", "")},
		{name: "unknown model", cred: byID(ten.KeyID), token: ten.Token, body: chat("nope", "")},
		{name: "model not allowed", cred: byID(smallOnlyID), token: smallOnlyTok, body: chat("chat", "")},
		{name: "allowed model", cred: byID(smallOnlyID), token: smallOnlyTok, body: chat("small", "")},
		{name: "blocked key", cred: byID(blockedID), token: blockedTok, body: chat("chat", "")},
		{name: "blocked customer", cred: byID(ten.KeyID), token: ten.Token, headers: map[string]string{dataplane.HeaderEndUser: "acme"}, body: chat("chat", "")},
		{name: "no tool calling in the group", cred: byID(ten.KeyID), token: ten.Token, body: chat("small", tools)},
		{name: "prompt above max_input_tokens", cred: byID(ten.KeyID), token: ten.Token, body: long},
		{name: "estimate above the tpm limit", cred: byID(tpmID), token: tpmTok, body: chat("chat", `,"n":8`)},
		{name: "session", cred: byID(ten.KeyID), token: ten.Token, headers: map[string]string{dataplane.HeaderSession: "conv-42"}, body: chat("chat", "")},
		{name: "shape: prompt and max_tokens", cred: byID(ten.KeyID), token: ten.Token,
			shape: &configv1.ExplainQuery{Model: "small", PromptBytes: 40, MaxTokens: 16},
			body:  `{"max_tokens":16,"messages":[{"content":"` + strings.Repeat("x", 40) + `","role":"user"}],"model":"small"}`},
	}
	require.Len(t, cases, 20)
	allDeps := map[string]bool{depA: true, depB: true, depGold: true, depSmall: true}
	for _, tc := range cases {
		q := &configv1.ExplainQuery{Headers: tc.headers}
		if tc.shape != nil {
			q = tc.shape
			q.Headers = tc.headers
		} else {
			q.Body = []byte(tc.body)
		}
		tc.cred(q)
		r, err := ex.Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Region: "default", Query: q}))
		require.NoError(t, err, tc.name)
		tr := r.Msg.GetTrace()
		require.NotZero(t, tr.GetSnapshotVersion(), tc.name)
		require.NotContains(t, protoText(t, tr), tc.token, "%s: the trace never carries the token", tc.name)

		status, code, hd := sendChat(t, p, tc.token, tc.body, tc.headers)
		out := tr.GetOutcome()
		require.Equal(t, int(out.GetStatus()), status, "%s: explained %d %s (%s), proxy answered %d %s", tc.name, out.GetStatus(), out.GetErrorCode(), out.GetMessage(), status, code)
		require.Equal(t, out.GetErrorCode(), code, tc.name)
		if tr.GetAuth().GetAuthenticated() || tr.GetAuth().GetKeyId() != "" {
			row := waitRow(t, d, hd.Get(dataplane.RequestIDHeader))
			require.Equal(t, tr.GetAuth().GetKeyId(), row.key, tc.name)
			require.Equal(t, out.GetErrorCode(), row.code, tc.name)
			if tr.GetModel() != nil && out.GetStage() != "resolve" {
				require.Equal(t, tr.GetModel().GetGroup(), row.group, tc.name)
			}
			if status == http.StatusOK {
				order := tr.GetRouting().GetOrder()
				require.Contains(t, order, row.dep, "%s: served by %s, explained candidates %v", tc.name, row.dep, order)
				if tr.GetRouting().GetReason() != "shuffle" || len(order) == 1 {
					require.Equal(t, order[0], row.dep, "%s: routing reason %s", tc.name, tr.GetRouting().GetReason())
				}
				require.Equal(t, tr.GetTrafficClass().GetClass(), hd.Get("X-Sluice-Traffic-Class"), tc.name)
				require.Equal(t, tr.GetTrafficClass().GetReason(), hd.Get("X-Sluice-Class-Reason"), tc.name)
				var cands []string
				for _, dep := range tr.GetDeployments() {
					require.True(t, allDeps[dep.GetId()], tc.name)
					if dep.GetCandidate() {
						cands = append(cands, dep.GetId())
					} else {
						require.NotEmpty(t, dep.GetFilteredBy(), "%s: %s is neither a candidate nor filtered", tc.name, dep.GetId())
					}
				}
				slices.Sort(cands)
				sorted := slices.Clone(order)
				slices.Sort(sorted)
				require.Equal(t, cands, sorted, tc.name)
			}
		}
		t.Logf("%-40s %d %-28s class=%s group=%s order=%v reason=%s", tc.name, out.GetStatus(), out.GetErrorCode(),
			tr.GetTrafficClass().GetClass(), tr.GetModel().GetGroup(), tr.GetRouting().GetOrder(), tr.GetRouting().GetReason())
	}

	// What the cases above explained, checked in detail once.
	explain := func(q *configv1.ExplainQuery) *configv1.ExplainTrace {
		t.Helper()
		r, err := ex.Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: q}))
		require.NoError(t, err)
		return r.Msg.GetTrace()
	}
	tr := explain(&configv1.ExplainQuery{KeyId: ten.KeyID, Body: []byte(chat("chat", tools))})
	reasons := map[string]string{}
	for _, dep := range tr.GetDeployments() {
		reasons[dep.GetId()] = dep.GetFilteredBy()
	}
	require.Equal(t, map[string]string{depA: "", depB: "capabilities", depGold: "tag_pool"}, reasons)
	tr = explain(&configv1.ExplainQuery{KeyId: teamKeyID, Model: "gpt-4o"})
	require.Equal(t, "team", tr.GetModel().GetAliasSource())
	require.Equal(t, "chat", tr.GetModel().GetGroup())
	require.Equal(t, "agent", tr.GetTrafficClass().GetClass())
	require.Equal(t, "credential", tr.GetTrafficClass().GetReason())
	// A session's second request goes where its pin points.
	harness.Eventually(t, func() bool {
		tr = explain(&configv1.ExplainQuery{KeyId: ten.KeyID, Model: "chat", Headers: map[string]string{dataplane.HeaderSession: "conv-42"}})
		return tr.GetRouting().GetPinned() != ""
	}, 10*time.Second, 50*time.Millisecond, "the session's pin is never explained")
	require.Equal(t, "session", tr.GetRouting().GetReason())
	require.Equal(t, tr.GetRouting().GetPinned(), tr.GetRouting().GetOrder()[0])

	// Headroom is read, never consumed: the rpm key is explained twice,
	// then its one request a minute passes and the next is refused, as
	// explain now says.
	for range 2 {
		tr = explain(&configv1.ExplainQuery{KeyId: rpmID, Model: "chat"})
		require.Equal(t, int32(http.StatusOK), tr.GetOutcome().GetStatus())
		require.Len(t, tr.GetScopes(), 1)
		require.Equal(t, int64(1), tr.GetScopes()[0].GetRpmLimit())
		require.Equal(t, int64(0), tr.GetScopes()[0].GetRpmUsed())
	}
	status, _, _ := sendChat(t, p, rpmTok, chat("chat", ""), nil)
	require.Equal(t, http.StatusOK, status)
	tr = explain(&configv1.ExplainQuery{KeyId: rpmID, Model: "chat"})
	require.Equal(t, dataplane.CodeRateLimitExceeded, tr.GetOutcome().GetErrorCode())
	require.Equal(t, int64(1), tr.GetScopes()[0].GetRpmUsed())
	require.Equal(t, "rpm", tr.GetScopes()[0].GetWouldExceed())
	_, code, _ := sendChat(t, p, rpmTok, chat("chat", ""), nil)
	require.Equal(t, dataplane.CodeRateLimitExceeded, code)

	// Tenant isolation on the live data plane: another org's token
	// explains neither this org's key (by id or by token) nor an unknown
	// token; its own key it does. (Issuers of other orgs: gateway
	// TestExplainJWTClaims.)
	otherTok := d.adminToken(t, adminv1.Scope_SCOPE_ORG, other.OrgID, "")
	oc := d.explainClient(otherTok)
	for _, q := range []*configv1.ExplainQuery{{KeyId: ten.KeyID, Model: "chat"}, {Token: ten.Token, Model: "chat"}, {Token: "sk-sluice-unknown", Model: "chat"}} {
		_, err := oc.Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: q}))
		require.Equal(t, connect.CodeNotFound, connect.CodeOf(err), "%v", err)
	}
	r, err := oc.Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: other.Token, Model: "chat"}}))
	require.NoError(t, err)
	require.Equal(t, other.KeyID, r.Msg.GetTrace().GetAuth().GetKeyId())
	teamTok := d.adminToken(t, adminv1.Scope_SCOPE_TEAM, ten.OrgID, ten.TeamID)
	_, err = d.explainClient(teamTok).Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: teamKeyTok, Model: "chat"}}))
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err), "a team token cannot explain another team's key: %v", err)
	_, err = d.explainClient(teamTok).Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: ten.Token, Model: "chat"}}))
	require.NoError(t, err)

	// No data plane of the region: unavailable.
	p.Cancel()
	harness.Eventually(t, func() bool {
		_, err := ex.Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{Query: &configv1.ExplainQuery{KeyId: ten.KeyID, Model: "chat"}}))
		return connect.CodeOf(err) == connect.CodeUnavailable
	}, 15*time.Second, 100*time.Millisecond, "explain without a data plane is not unavailable")
}

// sendChat posts body to p's chat route with tok and headers and returns
// the status, the error code and the response headers.
func sendChat(t *testing.T, p *proxy, tok, body string, headers map[string]string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", bytes.NewReader([]byte(body)))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+tok)
	req.Header.Set("Content-Type", "application/json")
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var e struct {
		Error struct {
			Code string `json:"code"`
		} `json:"error"`
	}
	if resp.StatusCode != http.StatusOK {
		require.NoError(t, json.Unmarshal(out, &e), "%s", out)
	}
	return resp.StatusCode, e.Error.Code, resp.Header
}

func waitRow(t *testing.T, d *dist, id string) *spendRow {
	t.Helper()
	var row *spendRow
	harness.Eventually(t, func() bool { row = d.spendRows(t)[id]; return row != nil }, 15*time.Second, 50*time.Millisecond, "no ledger row for %s", id)
	return row
}

func protoText(t *testing.T, tr *configv1.ExplainTrace) string {
	t.Helper()
	return fmt.Sprint(tr)
}

// adminToken creates an admin token (role viewer) of scope.
func (d *dist) adminToken(t *testing.T, scope adminv1.Scope, orgID, teamID string) string {
	t.Helper()
	c := adminv1connect.NewAdminTokenServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
	r, err := c.CreateAdminToken(context.Background(), connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "explain", Scope: scope, OrgId: orgID, TeamId: teamID, Role: adminv1.Role_ROLE_VIEWER}))
	require.NoError(t, err)
	return r.Msg.Token
}
