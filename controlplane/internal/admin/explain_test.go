package admin

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// explainBundle is an admin API with a NATS connection, so Explain
// reaches whatever answers the region's explain subject.
func explainBundle(t *testing.T) (*bundle, *nats.Conn) {
	t.Helper()
	ns := testsvc.StartNATS(t)
	nc, err := nats.Connect(ns.URL)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	pool, url := testsvc.NewPool(t)
	b := setupOn(t, pool, url, func(o *Options) { o.NATS = nc })
	return b, nc
}

func (b *bundle) explainClient(tok string) adminv1connect.ExplainServiceClient {
	return adminv1connect.NewExplainServiceClient(http.DefaultClient, b.url, connect.WithInterceptors(bearer(tok)))
}

// TestExplainForwardsTheCallersScope: the control plane sends the query
// with the caller's tenant scope to one data plane of the region and
// returns its trace; the data plane's not_found is NotFound.
func TestExplainForwardsTheCallersScope(t *testing.T) {
	t.Parallel()
	b, nc := explainBundle(t)
	fx := b.mkFixture("explain")
	var mu sync.Mutex
	var seen []*configv1.ExplainWireRequest
	// A stand-in for the region's data planes (the real one runs the
	// gateway's dry run: e2e/system TestExplainAgreesWithTheProxy).
	sub, err := nc.QueueSubscribe(wire.ExplainSubject("default"), wire.ExplainQueue, func(m *nats.Msg) {
		req := &configv1.ExplainWireRequest{}
		require.NoError(t, wire.Unmarshal(m.Data, req))
		mu.Lock()
		seen = append(seen, req)
		mu.Unlock()
		rep := &configv1.ExplainWireReply{Trace: &configv1.ExplainTrace{Region: "default", Auth: &configv1.ExplainAuth{KeyId: req.GetQuery().GetKeyId()}}}
		if req.GetQuery().GetToken() != "" {
			rep = &configv1.ExplainWireReply{Error: "not_found"}
		}
		data, _ := wire.Marshal(rep)
		_ = m.Respond(data)
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	ctx := context.Background()
	orgTok := b.mkToken(adminv1.Scope_SCOPE_ORG, adminv1.Role_ROLE_VIEWER, fx.team1.OrgID, "")
	teamTok := b.mkToken(adminv1.Scope_SCOPE_TEAM, adminv1.Role_ROLE_VIEWER, fx.team1.OrgID, fx.team1.TeamID)
	for _, c := range []struct {
		tok, org, team string
	}{{b.bootstrap, "", ""}, {orgTok, fx.team1.OrgID, ""}, {teamTok, fx.team1.OrgID, fx.team1.TeamID}} {
		// The region may be left out: "default" is the only one.
		resp, err := b.explainClient(c.tok).Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{
			Query: &configv1.ExplainQuery{KeyId: fx.team1.KeyID, Model: fx.team1.ModelGroup}}))
		require.NoError(t, err)
		require.Equal(t, fx.team1.KeyID, resp.Msg.GetTrace().GetAuth().GetKeyId())
		mu.Lock()
		last := seen[len(seen)-1]
		mu.Unlock()
		require.Equal(t, c.org, last.GetScopeOrgId())
		require.Equal(t, c.team, last.GetScopeTeamId())
	}
	n := len(seen)
	// The other team's key is refused by the control plane itself.
	_, err = b.explainClient(teamTok).Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{
		Query: &configv1.ExplainQuery{KeyId: fx.team2.KeyID, Model: fx.team2.ModelGroup}}))
	require.Equal(t, "not_found", codeOf(err), "%v", err)
	mu.Lock()
	require.Len(t, seen, n, "a key outside the scope is not forwarded")
	mu.Unlock()
	// A token the data plane does not find in the scope.
	_, err = b.explainClient(orgTok).Explain(ctx, connect.NewRequest(&adminv1.ExplainRequest{
		Query: &configv1.ExplainQuery{Token: "sk-sluice-elsewhere", Model: "m"}}))
	require.Equal(t, "not_found", codeOf(err), "%v", err)
}

// TestExplainWithoutDataPlaneIsUnavailable: nobody answers the region's
// subject: unavailable, naming the region.
func TestExplainWithoutDataPlaneIsUnavailable(t *testing.T) {
	t.Parallel()
	b, _ := explainBundle(t)
	fx := b.mkFixture("explain-none")
	_, err := b.explainClient(b.bootstrap).Explain(context.Background(), connect.NewRequest(&adminv1.ExplainRequest{
		Region: "default", Query: &configv1.ExplainQuery{KeyId: fx.team1.KeyID, Model: "m"}}))
	require.Equal(t, "unavailable", codeOf(err), "%v", err)
	require.Contains(t, err.Error(), "region default")
}

// TestExplainRefusesMalformedQueries names the field of each bad query,
// before anything is forwarded.
func TestExplainRefusesMalformedQueries(t *testing.T) {
	t.Parallel()
	b := setup(t)
	c := b.explainClient(b.bootstrap)
	for _, tc := range []struct {
		name  string
		req   *adminv1.ExplainRequest
		field string
	}{
		{"no query", &adminv1.ExplainRequest{}, "query"},
		{"no credential", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Model: "m"}}, "exactly one of key_id, token and jwt"},
		{"two credentials", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{KeyId: "key_x", Token: "sk-sluice-x", Model: "m"}}, "exactly one"},
		{"bad region", &adminv1.ExplainRequest{Region: "Not A Region", Query: &configv1.ExplainQuery{Token: "t", Model: "m"}}, "region"},
		{"credential header", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Model: "m",
			Headers: map[string]string{"Authorization": "Bearer x"}}}, "query.headers[Authorization]"},
		{"bad header name", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Model: "m",
			Headers: map[string]string{"bad header": "x"}}}, "query.headers[bad header]"},
		{"unknown route", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Model: "m", Route: "/v1/nope"}}, "query.route"},
		{"no model", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t"}}, "query.model"},
		{"body and shape", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Model: "m", Body: []byte(`{}`)}}, "query.body"},
		{"huge body", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Body: make([]byte, 600<<10)}}, "query.body"},
		{"negative n", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Model: "m", N: -1}}, "query.n"},
		{"huge prompt", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Token: "t", Model: "m", PromptBytes: 1 << 40}}, "query.prompt_bytes"},
		{"jwt without issuer", &adminv1.ExplainRequest{Query: &configv1.ExplainQuery{Jwt: &configv1.ExplainJWTClaims{}, Model: "m"}}, "query.jwt.issuer"},
	} {
		_, err := c.Explain(context.Background(), connect.NewRequest(tc.req))
		require.Equal(t, "invalid_argument", codeOf(err), "%s: %v", tc.name, err)
		require.True(t, strings.Contains(err.Error(), tc.field), "%s: %v should name %s", tc.name, err, tc.field)
	}
}
