package system

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// received counts the generation requests a simulator received.
func received(s *vllmsim.Server) uint64 {
	var n uint64
	for _, c := range s.ReceivedPriorities() {
		n += c
	}
	return n
}

type fbAnswer struct {
	status  int
	group   string
	code    string
	message string
}

func fbPost(t *testing.T, p *proxy, tok, body string) fbAnswer {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, p.URL+"/v1/chat/completions", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var e struct {
		Error struct{ Code, Message string } `json:"error"`
	}
	_ = json.Unmarshal(b, &e)
	return fbAnswer{resp.StatusCode, resp.Header.Get(dataplane.HeaderModelGroup), e.Error.Code, e.Error.Message}
}

// TestFallbackSafety (SPEC §7.3): model groups with fallbacks set through
// the admin API and published to a real data plane. A request with
// `tools` whose primary engine is dead never falls back to a group
// without tool calling (the answer names why it was skipped, and that
// engine receives nothing), while a fallback that fits serves it; a
// prompt beyond the primary's context window goes to a larger one; a
// key's and a team's override replace the group's list.
func TestFallbackSafety(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	mk := func() *vllmsim.Server {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr, cfg.TimeScale, cfg.MeanOutputTokens = "127.0.0.1:0", 20, 4
		return harness.StartSim(t, cfg)
	}
	dead, plain, tooled, large := mk(), mk(), mk(), mk()
	require.NoError(t, dead.SetRefuseConnections(true))
	m := d.modelClient()
	group := func(name string, s *vllmsim.Server, caps *adminv1.Capabilities) {
		_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: name, PlatformWide: true}))
		require.NoError(t, err)
		_, err = m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{ModelGroup: name, ApiBase: s.URL() + "/v1",
			UpstreamModel: vllmsim.DefaultModel, Weight: 1, Capabilities: caps, Prices: &adminv1.Prices{InputPerToken: 1e-6, OutputPerToken: 3e-6}}))
		require.NoError(t, err)
	}
	group("agentic", dead, &adminv1.Capabilities{Tools: true, MaxInputTokens: 100})
	group("plain", plain, &adminv1.Capabilities{MaxInputTokens: 100000})
	group("tooled", tooled, &adminv1.Capabilities{Tools: true, MaxInputTokens: 100})
	group("large", large, &adminv1.Capabilities{Tools: true, MaxInputTokens: 100000})
	setFallbacks := func(name string, fb ...string) error {
		_, err := m.UpdateModelGroup(ctx, connect.NewRequest(&adminv1.UpdateModelGroupRequest{
			ModelGroup: &adminv1.ModelGroup{Name: name, Fallbacks: fb}, UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"fallbacks"}}}))
		return err
	}
	// Strict validation: unknown group, self-reference, cycle.
	for _, bad := range [][]string{{"nope"}, {"agentic"}} {
		err := setFallbacks("agentic", bad...)
		require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", bad)
	}
	require.NoError(t, setFallbacks("plain", "tooled"))
	err := setFallbacks("tooled", "plain")
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err))
	require.Contains(t, err.Error(), "cycle: tooled → plain → tooled")
	require.NoError(t, setFallbacks("plain"))
	require.NoError(t, setFallbacks("agentic", "plain"))

	ten := d.NewTenant("fallback")
	p := d.StartProxy("default", time.Minute, func(c *dataplane.Config) { c.RetryBudgetMin = 1000 })
	harness.Eventually(t, func() bool {
		g := p.DP.Catalog().ModelGroup("agentic")
		return len(g.GetFallbacks()) == 1 && len(p.DP.Catalog().Deployments("large")) == 1
	}, 10*time.Second, 10*time.Millisecond)
	harness.WaitStatus(t, p, ten.Token, http.StatusOK, 10*time.Second)

	withTools := `{"model":"agentic","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}`
	for range 5 { // connection refused, then ejected: never to the group without tools
		a := fbPost(t, p, ten.Token, withTools)
		require.Equal(t, http.StatusBadGateway, a.status, "%+v", a)
		require.Equal(t, "upstream_error", a.code)
		require.Contains(t, a.message, `model group "plain" skipped: no deployment of model "plain" supports tool calling`)
	}
	require.Zero(t, received(plain), "the group without tool calling received a request with tools")

	// A fallback that fits: served there, named in the header.
	require.NoError(t, setFallbacks("agentic", "plain", "tooled"))
	harness.Eventually(t, func() bool { return len(p.DP.Catalog().ModelGroup("agentic").GetFallbacks()) == 2 }, 10*time.Second, 10*time.Millisecond)
	for range 3 {
		a := fbPost(t, p, ten.Token, withTools)
		require.Equal(t, http.StatusOK, a.status, "%+v", a)
		require.Equal(t, "tooled", a.group)
	}
	require.Zero(t, received(plain))

	// Context window: a long prompt skips "tooled" (100 tokens) for
	// "large" once the key's override names it.
	long := `{"model":"agentic","messages":[{"role":"user","content":"` + strings.Repeat("a long prompt ", 100) + `"}],"max_tokens":4}`
	a := fbPost(t, p, ten.Token, long)
	require.Equal(t, "plain", a.group, "the first fallback whose window fits")
	keys := d.Clients().Key
	k, err := keys.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: ten.OrgID, TeamId: ten.TeamID, UserId: ten.UserID,
		Fallbacks: map[string]*adminv1.ModelGroupFallbacks{"agentic": {ModelGroups: []string{"tooled", "large"}}}}))
	require.NoError(t, err)
	harness.Eventually(t, func() bool { return fbPost(t, p, k.Msg.GetToken(), long).group == "large" }, 10*time.Second, 20*time.Millisecond,
		"the key's override: tooled's window is too small, large fits")

	// The team's override applies to the tenant's first key.
	_, err = d.Clients().Team.UpdateTeam(ctx, connect.NewRequest(&adminv1.UpdateTeamRequest{
		Team:       &adminv1.Team{Id: ten.TeamID, Fallbacks: map[string]*adminv1.ModelGroupFallbacks{"agentic": {ModelGroups: []string{"large"}}}},
		UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"fallbacks"}}}))
	require.NoError(t, err)
	harness.Eventually(t, func() bool { return fbPost(t, p, ten.Token, withTools).group == "large" }, 10*time.Second, 20*time.Millisecond,
		"the team's override")
	require.Equal(t, uint64(1), received(plain), "plain served the long prompt without tools, nothing with tools")
}
