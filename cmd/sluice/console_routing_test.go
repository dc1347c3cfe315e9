package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// chat sends one chat completion to the proxy and returns the response's
// status, its traffic-class headers and its body (read whole). A 503
// limits_unavailable (the limits store slow to answer on a loaded
// machine) is sent again for up to 15 s.
func chat(t *testing.T, proxyURL, tok, model, userAgent string, stream bool) (int, string, string) {
	t.Helper()
	body := `{"model":"` + model + `","messages":[{"role":"user","content":"Hello!"}],"max_tokens":8`
	if stream {
		body += `,"stream":true`
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		req, _ := http.NewRequest(http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(body+"}"))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Content-Type", "application/json")
		if userAgent != "" {
			req.Header.Set("User-Agent", userAgent)
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(string(b), `"limits_unavailable"`) && time.Now().Before(deadline) {
			continue
		}
		return resp.StatusCode, resp.Header.Get("X-Sluice-Traffic-Class") + " " + resp.Header.Get("X-Sluice-Class-Reason"), string(b)
	}
}

// TestConsoleRoutingPages drives the console's routing pages in headless
// Chromium against a whole `sluice dev` system: an org editor adds a
// classification rule on the Traffic classes page (the proxy then classes
// a request by it) and explains a request on the Explain page (the trace
// names the rule); streamed requests draw the TTFT plot on Requests &
// TTFT; a deployment an engine parked with Retry-After shows on the
// platform's Health & queues page with every instance's backlog per
// class; a team viewer is shown no way to change traffic settings.
func TestConsoleRoutingPages(t *testing.T) {
	dir := t.TempDir()
	var rb [6]byte
	_, _ = rand.Read(rb[:])
	suffix := hex.EncodeToString(rb[:])
	prefix := "consoleroutes-" + suffix + ":"
	t.Cleanup(func() { cleanRedis(t, prefix) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dev.json"), []byte("{}"), 0o600))
	dev := startDev(t, dir, testsvc.NewDatabase(t), prefix)
	st := dev.state
	ctx := context.Background()

	hc := &http.Client{Timeout: 30 * time.Second}
	platform := connect.WithInterceptors(bearerAuth(st.AdminToken))
	tokens := adminv1connect.NewAdminTokenServiceClient(hc, st.AdminURL, platform)
	keys := adminv1connect.NewKeyServiceClient(hc, st.AdminURL, platform)
	models := adminv1connect.NewModelServiceClient(hc, st.AdminURL, platform)
	traffic := adminv1connect.NewTrafficServiceClient(hc, st.AdminURL, platform)
	fleet := adminv1connect.NewFleetServiceClient(hc, st.AdminURL, platform)
	spend := adminv1connect.NewSpendServiceClient(hc, st.AdminURL, platform)

	orgTok, err := tokens.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "console-routing", Scope: adminv1.Scope_SCOPE_ORG, OrgId: st.OrgID, Role: adminv1.Role_ROLE_EDITOR}))
	require.NoError(t, err)
	// An org key naming no class: rules and the default class it.
	ruleKey, err := keys.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: st.OrgID, Alias: "rules-" + suffix}))
	require.NoError(t, err)

	orgs := adminv1connect.NewOrgServiceClient(hc, st.AdminURL, platform)
	other, err := orgs.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: "other-" + suffix}))
	require.NoError(t, err)
	otherKey, err := keys.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{OrgId: other.Msg.Org.Id, Alias: "hidden-" + suffix}))
	require.NoError(t, err)

	// A pool whose only engine answers 429 with Retry-After: the proxy
	// parks the deployment (docs/resilience.md).
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "60")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = io.WriteString(w, `{"error":{"message":"busy","type":"rate_limit_error"}}`)
	}))
	t.Cleanup(engine.Close)
	parkedGroup := "parked-" + suffix
	_, err = models.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: parkedGroup, PlatformWide: true}))
	require.NoError(t, err)
	pd, err := models.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
		ModelGroup: parkedGroup, ApiBase: engine.URL + "/v1", UpstreamModel: "busy-model", Weight: 1,
		Prices: &adminv1.Prices{InputPerToken: 0.0000002, OutputPerToken: 0.0000006}}))
	require.NoError(t, err)
	parkedID := pd.Msg.Deployment.Id
	// A healthy second engine: with one of two out the pool stays within
	// the maximum ejection share, so the parked one stays out.
	_, err = models.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
		ModelGroup: parkedGroup, ApiBase: st.Engines[devEngines[0]] + "/v1", UpstreamModel: vllmsim.DefaultModel, Weight: 1,
		Prices: &adminv1.Prices{InputPerToken: 0.0000002, OutputPerToken: 0.0000006}}))
	require.NoError(t, err)

	// Streams for the TTFT plot, then the parked deployment.
	dev.authenticates(t, st.Keys["human"], 15*time.Second)
	for range 3 {
		status, _, body := chat(t, st.ProxyURL, st.Keys["human"], devModel, "", true)
		require.Equal(t, http.StatusOK, status, body)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		status, _, body := chat(t, st.ProxyURL, ruleKey.Msg.Token, parkedGroup, "", false)
		require.Equal(t, http.StatusOK, status, "a 429 is retried on the healthy engine: %s", body)
		dl, err := fleet.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
		require.NoError(t, err)
		parked := false
		for _, d := range dl.Msg.DataPlanes {
			for _, e := range d.EjectedDeployments {
				parked = parked || (e.DeploymentId == parkedID && e.Reason == "parked")
			}
		}
		if parked {
			break
		}
		require.False(t, time.Now().After(deadline), "no heartbeat reports %s parked after 30 s (last answer %d %s)", parkedID, status, body)
		time.Sleep(200 * time.Millisecond)
	}
	// A rejection for the Requests page: an unknown model.
	status, _, body := chat(t, st.ProxyURL, ruleKey.Msg.Token, "no-such-model-"+suffix, "", false)
	require.Equal(t, http.StatusNotFound, status, body)
	deadline = time.Now().Add(30 * time.Second)
	for {
		r, err := spend.ListSpendLogs(ctx, connect.NewRequest(&adminv1.ListSpendLogsRequest{OrgId: st.OrgID}))
		require.NoError(t, err)
		streams, rejected := 0, 0
		for _, l := range r.Msg.Logs {
			if l.TtftMs > 0 && l.Route == "/v1/chat/completions" {
				streams++
			}
			if l.ErrorCode == "model_not_found" {
				rejected++
			}
		}
		if streams >= 3 && rejected == 1 {
			break
		}
		require.False(t, time.Now().After(deadline), "the ledger has %d of 3 streams with a TTFT after 30 s", streams)
		time.Sleep(100 * time.Millisecond)
	}

	b := newBrowser(t, st.AdminURL+"/console/")
	b.login(orgTok.Msg.Token)
	require.Equal(t, "0", b.eval(`String(document.querySelectorAll('#nav a[data-page="health"]').length)`), "an org token is not shown the fleet's health")

	// Traffic classes: the demo org has no rule yet; add one.
	b.page("traffic")
	require.Contains(t, b.text(`table[data-test="rules"]`), "none")
	require.NotContains(t, b.text(`#main`), "null", "no missing value is drawn as text")
	require.Contains(t, b.text(`table[data-test="credential-classes"]`), "agent", "the demo agent key's class")
	require.Contains(t, b.text(`table[data-test="deployment-admission"]`), "on (interactive 0, agent 10, batch 20)", "the demo pool's priority scheduling")
	b.do("add a classification rule",
		chromedp.Click(chromedp.CSS(`button[data-test="add-rule"]`)),
		chromedp.SendKeys(chromedp.CSS(`table[data-test="rule-editor"] tr.rule input[name="header"]`), "User-Agent"),
		chromedp.SendKeys(chromedp.CSS(`table[data-test="rule-editor"] tr.rule input[name="pattern"]`), "^console-test/"),
		chromedp.SetValue(chromedp.CSS(`table[data-test="rule-editor"] tr.rule select[name="trafficClass"]`), "TRAFFIC_CLASS_BATCH"),
		chromedp.Click(chromedp.CSS(`button[data-test="save-traffic"]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-test="traffic-saved"]`)))
	require.Contains(t, b.text(`table[data-test="rules"]`), "^console-test/")
	ot, err := traffic.GetOrgTraffic(ctx, connect.NewRequest(&adminv1.GetOrgTrafficRequest{OrgId: st.OrgID}))
	require.NoError(t, err)
	require.Len(t, ot.Msg.Traffic.GetRules(), 1)
	require.Equal(t, "User-Agent", ot.Msg.Traffic.Rules[0].Header)
	require.Equal(t, adminv1.TrafficClass_TRAFFIC_CLASS_BATCH, ot.Msg.Traffic.Rules[0].TrafficClass)
	// A bad pattern is refused by the API and the form says why.
	b.do("save a bad rule",
		chromedp.Click(chromedp.CSS(`button[data-test="add-rule"]`)),
		chromedp.SendKeys(chromedp.CSS(`table[data-test="rule-editor"] tr.rule:last-child input[name="header"]`), "X-Job"),
		chromedp.SendKeys(chromedp.CSS(`table[data-test="rule-editor"] tr.rule:last-child input[name="pattern"]`), "(unclosed"),
		chromedp.Click(chromedp.CSS(`button[data-test="save-traffic"]`)))
	b.do("the refusal", chromedp.Poll[chromedp.Void](`document.querySelector('[data-test="traffic-error"]').textContent.includes('invalid_argument')`))

	// The proxy classes by the rule once the data plane has it.
	deadline = time.Now().Add(20 * time.Second)
	for {
		status, cls, body := chat(t, st.ProxyURL, ruleKey.Msg.Token, devModel, "console-test/1.0", false)
		require.Equal(t, http.StatusOK, status, body)
		if cls == "batch rule:0" {
			break
		}
		require.False(t, time.Now().After(deadline), "the proxy classes the request %q, want batch by rule:0", cls)
		time.Sleep(50 * time.Millisecond)
	}

	// Explain: the same request is explained as classed by the rule and
	// forwarded to a demo deployment.
	b.page("explain")
	b.do("explain a request",
		chromedp.SetValue(chromedp.CSS(`form[data-test="explain-form"] select[name="keyId"]`), ruleKey.Msg.Key.Id),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="explain-form"] input[name="model"]`), devModel),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="explain-form"] textarea[name="headers"]`), "User-Agent: console-test/1.0"),
		chromedp.Click(chromedp.CSS(`button[data-test="explain"]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-test="outcome"]`)))
	require.Contains(t, b.text(`[data-test="outcome"]`), "200: forwarded to dep_")
	cls := b.text(`table[data-test="trace-class"]`)
	require.Contains(t, cls, "batch")
	require.Contains(t, cls, "rule:0")
	require.Contains(t, b.text(`table[data-test="trace-model"]`), devModel)
	require.NotContains(t, b.text(`[data-test="explain-result"]`), "null", "no missing value is drawn as text")
	require.Equal(t, "2", b.eval(`String(document.querySelectorAll('table[data-test="trace-deployments"] td .ok').length)`), "both demo engines are candidates")
	require.Contains(t, b.text(`table[data-test="trace-scopes"]`), "org "+st.OrgID, "the org's budget scope")
	// The parked pool: the parked deployment is filtered by health.
	b.do("explain a request to the parked pool",
		chromedp.SetValue(chromedp.CSS(`form[data-test="explain-form"] input[name="model"]`), parkedGroup),
		chromedp.Click(chromedp.CSS(`button[data-test="explain"]`)),
		chromedp.Poll[chromedp.Void](`document.querySelector('table[data-test="trace-deployments"] tr[data-id="`+parkedID+`"]')?.textContent.includes('filtered by health')`))
	require.Contains(t, b.text(`[data-test="outcome"]`), "200: forwarded to dep_", "to the healthy engine")
	if dir := os.Getenv(screenshotsEnv); dir != "" {
		b.do("explain the demo request again for the screenshot",
			chromedp.SetValue(chromedp.CSS(`form[data-test="explain-form"] input[name="model"]`), devModel),
			chromedp.Click(chromedp.CSS(`button[data-test="explain"]`)),
			chromedp.WaitVisible(chromedp.CSS(`[data-test="outcome"].ok`)))
		require.NoError(t, os.MkdirAll(dir, 0o755))
		b.screenshot(dir, "org-explain")
	}
	// Another org's key is not found for this token.
	require.Equal(t, "not_found",
		b.eval(`rpc('ExplainService','Explain',{query:{keyId:'`+otherKey.Msg.Key.Id+`',model:'`+devModel+`'}}).then(() => 'explained', e => e.code)`))

	// Requests & TTFT: the streams' TTFT per hour and class.
	b.page("requests")
	b.do("TTFT plot", chromedp.WaitVisible(chromedp.CSS(`svg[data-test="plot-ttft"] circle`)))
	require.NotEqual(t, "0", b.eval(`String(document.querySelectorAll('svg[data-test="plot-ttft"] circle[data-series="interactive p50"]').length)`),
		"a p50 point for the demo human key's class")
	ttft := b.text(`table[data-test="ttft"]`)
	require.Contains(t, ttft, "/v1/chat/completions")
	require.Contains(t, ttft, "interactive")
	require.Contains(t, b.text(`table[data-test="rejections"]`), "model_not_found", "the unknown model's refusal by class and reason")
	require.NotEqual(t, "0", b.eval(`String(document.querySelectorAll('svg[data-test="plot-classes"] rect').length)`))

	// The platform sees the parked deployment and every instance's backlog.
	pb := newBrowser(t, st.AdminURL+"/console/")
	pb.login(st.AdminToken)
	pb.page("health")
	ej := pb.text(`table[data-test="ejected"]`)
	require.Contains(t, ej, parkedID)
	require.Contains(t, ej, "parked: engine Retry-After")
	require.Contains(t, pb.text(`table[data-test="deployment-health"] tr[data-id="`+parkedID+`"]`), "out on 1 of 1 (parked)")
	dl, err := fleet.ListDataPlanes(ctx, connect.NewRequest(&adminv1.ListDataPlanesRequest{}))
	require.NoError(t, err)
	require.Len(t, dl.Msg.DataPlanes, 1)
	inst := dl.Msg.DataPlanes[0]
	require.Len(t, inst.AdmissionBacklog, 3, "the heartbeat reports the backlog of every class")
	require.Equal(t, []string{"interactive", "agent", "batch"}, []string{inst.AdmissionBacklog[0].TrafficClass, inst.AdmissionBacklog[1].TrafficClass, inst.AdmissionBacklog[2].TrafficClass})
	backlog := pb.text(`table[data-test="backlog"] tr[data-id="` + inst.InstanceId + `"]`)
	require.Contains(t, backlog, inst.Region)
	require.Equal(t, "9", pb.eval(`String(document.querySelectorAll('table[data-test="backlog"] tr[data-id="`+inst.InstanceId+`"] td.num').length)`),
		"in flight, queued and shed of three classes")
	// A platform editor edits a deployment's class-aware admission.
	pb.page("traffic")
	pb.do("edit the parked deployment's admission",
		chromedp.Click(chromedp.CSS(`table[data-test="deployment-admission"] tr[data-id="`+parkedID+`"] button[data-test="edit-admission"]`)),
		chromedp.WaitVisible(chromedp.CSS(`form[data-test="admission-form"]`)),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="admission-form"] input[name="batchMaxConcurrency"]`), "3"),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="admission-form"] input[name="qto_TRAFFIC_CLASS_AGENT"]`), "5000"),
		chromedp.Click(chromedp.CSS(`form[data-test="admission-form"] button[type="submit"]`)),
		chromedp.WaitNotPresent(chromedp.CSS(`form[data-test="admission-form"]`)),
		chromedp.WaitVisible(chromedp.CSS(`body[data-ready="traffic"]`)))
	dt, err := traffic.GetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: parkedID}))
	require.NoError(t, err)
	require.EqualValues(t, 3, dt.Msg.Traffic.GetBatchMaxConcurrency())
	require.Len(t, dt.Msg.Traffic.GetQueues(), 1)
	require.Equal(t, adminv1.TrafficClass_TRAFFIC_CLASS_AGENT, dt.Msg.Traffic.Queues[0].TrafficClass)
	require.EqualValues(t, 5000, dt.Msg.Traffic.Queues[0].TimeoutMs)
	require.Contains(t, pb.text(`table[data-test="deployment-admission"] tr[data-id="`+parkedID+`"]`), "agent: timeout 5000 ms")

	// An org editor sets a key's class.
	b.page("traffic")
	b.do("set the rules key's class",
		chromedp.SetValue(chromedp.CSS(`table[data-test="credential-classes"] tr[data-id="key-`+ruleKey.Msg.Key.Id+`"] select`), "TRAFFIC_CLASS_AGENT"),
		chromedp.Click(chromedp.CSS(`table[data-test="credential-classes"] tr[data-id="key-`+ruleKey.Msg.Key.Id+`"] button[data-test="set-class"]`)))
	deadline = time.Now().Add(10 * time.Second)
	for {
		gk, err := keys.GetKey(ctx, connect.NewRequest(&adminv1.GetKeyRequest{Id: ruleKey.Msg.Key.Id}))
		require.NoError(t, err)
		if gk.Msg.Key.TrafficClass == adminv1.TrafficClass_TRAFFIC_CLASS_AGENT {
			break
		}
		require.False(t, time.Now().After(deadline), "the key's class is %s, want agent", gk.Msg.Key.TrafficClass)
		time.Sleep(50 * time.Millisecond)
	}
	b.do("the table shows it", chromedp.Poll[chromedp.Void](`document.querySelector('table[data-test="credential-classes"] tr[data-id="key-`+ruleKey.Msg.Key.Id+`"] td:nth-child(3)')?.textContent === 'agent'`))

	// A team viewer reads the deployments' settings and changes nothing.
	teamTok, err := tokens.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "console-routing-viewer", Scope: adminv1.Scope_SCOPE_TEAM, OrgId: st.OrgID, TeamId: st.TeamID, Role: adminv1.Role_ROLE_VIEWER}))
	require.NoError(t, err)
	tb := newBrowser(t, st.AdminURL+"/console/")
	tb.login(teamTok.Msg.Token)
	tb.page("traffic")
	require.Contains(t, tb.text(`table[data-test="deployment-admission"]`), "on (interactive 0, agent 10, batch 20)")
	require.Equal(t, "0", tb.eval(`String(document.querySelectorAll('form[data-test="org-traffic"], table[data-test="rules"], button[data-test="set-class"], button[data-test="edit-admission"]').length)`),
		"a team viewer is shown neither its org's rules nor a way to change classes")

	if dir := os.Getenv(screenshotsEnv); dir != "" {
		b.page("traffic")
		b.screenshot(dir, "org-traffic")
		b.page("requests")
		b.do("TTFT plot", chromedp.WaitVisible(chromedp.CSS(`svg[data-test="plot-ttft"] circle`)))
		b.screenshot(dir, "org-requests")
		pb.page("health")
		pb.screenshot(dir, "platform-health")
		pb.page("traffic")
		pb.screenshot(dir, "platform-traffic")
		tb.page("traffic")
		tb.screenshot(dir, "team-viewer-traffic")
		t.Logf("console screenshots in %s", dir)
	}
}
