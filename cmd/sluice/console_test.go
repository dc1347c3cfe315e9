package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// screenshotsEnv names a directory that receives one screenshot of each
// console page (for review); unset, none are kept.
const screenshotsEnv = "SLUICE_CONSOLE_SCREENSHOTS"

// chromiumPath finds the Debian chromium (deploy/local/services.sh
// installs it). A machine without it fails the test: it is part of the
// test setup like Postgres.
func chromiumPath(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("no chromium on PATH: run deploy/local/services.sh (it installs the Debian chromium package)")
	return ""
}

// browser is one headless Chromium tab on the console.
type browser struct {
	t   *testing.T
	ctx context.Context
	url string // the console's URL
}

func newBrowser(t *testing.T, consoleURL string) *browser {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromiumPath(t)), chromedp.NoSandbox,
		chromedp.Flag("disable-dev-shm-usage", true), chromedp.WindowSize(1600, 1000))
	actx, acancel := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx)
	t.Cleanup(func() { cancel(); acancel() })
	// The first action starts the browser and must run on ctx itself: a
	// derived context would stop the browser when it ends.
	if err := chromedp.Do(ctx, chromedp.Navigate("about:blank")); err != nil {
		t.Fatalf("chromium did not start (%s): %v", chromiumPath(t), err)
	}
	b := &browser{t: t, ctx: ctx, url: consoleURL}
	// Runs before the browser closes (cleanups run last-in first-out).
	t.Cleanup(func() {
		if t.Failed() {
			b.saveFailure()
		}
	})
	return b
}

// artifactDir is under the test's output with -artifacts, else a kept
// temporary directory.
func artifactDir(t *testing.T) string {
	if f := flag.Lookup("test.artifacts"); f != nil && f.Value.String() == "true" {
		return t.ArtifactDir()
	}
	dir, err := os.MkdirTemp("", "sluice-console-"+strings.ReplaceAll(t.Name(), "/", "_")+"-")
	if err != nil {
		t.Logf("artifact dir: %v", err)
		return ""
	}
	return dir
}

func (b *browser) saveFailure() {
	dir := artifactDir(b.t)
	if dir == "" {
		return
	}
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	if png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "failure.png"), png, 0o644)
	}
	if html, err := chromedp.Run(ctx, chromedp.OuterHTML(chromedp.CSS("html"))); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "failure.html"), []byte(html), 0o644)
	}
	b.t.Errorf("console failure artifacts (screenshot, page HTML) in %s", dir)
}

// do runs steps with a deadline, failing the test on error.
func (b *browser) do(what string, steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		b.t.Fatalf("%s: %v", what, err)
	}
}

func (b *browser) text(sel string) string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.TextContent(chromedp.CSS(sel)))
	require.NoError(b.t, err, "text of %s", sel)
	return s
}

func (b *browser) eval(js string) string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](js, chromedp.EvalAwaitPromise))
	require.NoError(b.t, err, "evaluate %s", js)
	return s
}

// login loads the console and logs in with tok.
func (b *browser) login(tok string) {
	b.t.Helper()
	b.do("log in", chromedp.Navigate(b.url), chromedp.WaitVisible(chromedp.CSS("#token")),
		chromedp.SendKeys(chromedp.CSS("#token"), tok), chromedp.Click(chromedp.CSS(`#login-form button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.CSS(`body[data-ready="overview"]`)))
}

// page opens a console page and waits until it has rendered.
func (b *browser) page(name string) {
	b.t.Helper()
	b.do("open page "+name, chromedp.Evaluate[chromedp.Void](`location.hash = '#/`+name+`'`),
		chromedp.WaitVisible(chromedp.CSS(`body[data-ready="`+name+`"]`)))
}

func (b *browser) screenshot(dir, name string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	require.NoError(b.t, err)
	require.NoError(b.t, os.WriteFile(filepath.Join(dir, name+".png"), png, 0o644))
}

// proxyStatus is the proxy's answer to tok on GET /v1/auth/check.
func proxyStatus(t *testing.T, proxyURL, tok string) int {
	req, _ := http.NewRequest(http.MethodGet, proxyURL+"/v1/auth/check", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// waitProxy polls until the proxy answers tok with want.
func waitProxy(t *testing.T, proxyURL, tok string, want int, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := proxyStatus(t, proxyURL, tok)
		if got == want {
			return
		}
		require.False(t, time.Now().After(deadline), "%s: the proxy answers %d, want %d", what, got, want)
		time.Sleep(20 * time.Millisecond)
	}
}

// TestConsoleInBrowser drives the web console in headless Chromium
// against a whole `sluice dev` system (control plane, data plane,
// simulated engines): an org-scoped token logs in, creates a key and sees
// its token once, blocks it (the proxy refuses it), unblocks and rotates
// it with grace (both tokens work), sees the spend plot drawn from the
// ledger, and sees nothing of another org.
func TestConsoleInBrowser(t *testing.T) {
	dir := t.TempDir()
	var rb [6]byte
	_, _ = rand.Read(rb[:])
	suffix := hex.EncodeToString(rb[:])
	prefix := "consoletest-" + suffix + ":"
	t.Cleanup(func() { cleanRedis(t, prefix) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dev.json"), []byte("{}"), 0o600))
	dev := startDev(t, dir, testsvc.NewDatabase(t), prefix)
	st := dev.state
	ctx := context.Background()

	hc := &http.Client{Timeout: 30 * time.Second}
	platform := connect.WithInterceptors(bearerAuth(st.AdminToken))
	tokens := adminv1connect.NewAdminTokenServiceClient(hc, st.AdminURL, platform)
	orgs := adminv1connect.NewOrgServiceClient(hc, st.AdminURL, platform)
	teams := adminv1connect.NewTeamServiceClient(hc, st.AdminURL, platform)
	keys := adminv1connect.NewKeyServiceClient(hc, st.AdminURL, platform)
	spend := adminv1connect.NewSpendServiceClient(hc, st.AdminURL, platform)

	// Another org the demo org's token must not see.
	other, err := orgs.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{Name: "other-" + suffix}))
	require.NoError(t, err)
	otherTeam, err := teams.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{OrgId: other.Msg.Org.Id, Name: "hidden-team-" + suffix}))
	require.NoError(t, err)
	orgTok, err := tokens.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "console-test", Scope: adminv1.Scope_SCOPE_ORG, OrgId: st.OrgID, Role: adminv1.Role_ROLE_EDITOR}))
	require.NoError(t, err)

	// Spend to plot: a few chat completions with the demo key, counted
	// once the ledger has them.
	dev.authenticates(t, st.Keys["human"], 15*time.Second)
	for range 3 {
		dev.authenticates(t, st.Keys["human"], time.Second)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		r, err := spend.ListSpendLogs(ctx, connect.NewRequest(&adminv1.ListSpendLogsRequest{OrgId: st.OrgID}))
		require.NoError(t, err)
		if len(r.Msg.Logs) >= 4 {
			break
		}
		require.False(t, time.Now().After(deadline), "the spend ledger has %d of 4 requests after 30 s", len(r.Msg.Logs))
		time.Sleep(100 * time.Millisecond)
	}

	b := newBrowser(t, st.AdminURL+"/console/")
	b.login(orgTok.Msg.Token)
	require.Contains(t, b.text("#who"), st.OrgID)
	require.Contains(t, b.text("#who"), "editor")
	require.Equal(t, "", b.eval(`sessionStorage.getItem('sluice.console.token') === null ? 'missing' : ''`), "the token is in session storage")
	require.NotContains(t, b.eval(`location.href`), orgTok.Msg.Token, "never in the URL")
	require.Equal(t, "0", b.eval(`String(document.querySelectorAll('#nav a[data-page="fleet"]').length)`), "an org token is not shown the fleet")

	// The org token sees its org only; the API refuses the other org.
	b.page("orgs")
	orgsText := b.text(`table[data-test="orgs"]`)
	require.Contains(t, orgsText, st.OrgID)
	require.NotContains(t, orgsText, other.Msg.Org.Id)
	b.page("teams")
	teamsText := b.text(`table[data-test="teams"]`)
	require.Contains(t, teamsText, "platform")
	require.NotContains(t, teamsText, otherTeam.Msg.Team.Name)
	hidden := []string{"not_found", "permission_denied"} // the API does not say whether it exists
	require.Contains(t, hidden, b.eval(`rpc('OrgService','GetOrg',{id:'`+other.Msg.Org.Id+`'}).then(() => 'visible', e => e.code)`))
	require.Contains(t, hidden, b.eval(`rpc('TeamService','GetTeam',{id:'`+otherTeam.Msg.Team.Id+`'}).then(() => 'visible', e => e.code)`))

	// Create a key: its token is shown once.
	b.page("keys")
	alias := "browser-" + suffix
	b.do("create a key",
		chromedp.SetValue(chromedp.CSS(`form[data-test="new-key"] select[name="teamId"]`), st.TeamID),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="new-key"] input[name="alias"]`), alias),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="new-key"] input[name="rpmLimit"]`), "100"),
		chromedp.Click(chromedp.CSS(`form[data-test="new-key"] button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#key-notice [data-test="token"]`)))
	keyTok := strings.TrimSpace(b.text(`#key-notice [data-test="token"]`))
	require.True(t, strings.HasPrefix(keyTok, "sk-sluice-"), "a key token: %q", keyTok)
	kl, err := keys.ListKeys(ctx, connect.NewRequest(&adminv1.ListKeysRequest{OrgId: st.OrgID, AliasPrefix: alias}))
	require.NoError(t, err)
	require.Len(t, kl.Msg.Keys, 1)
	keyID := kl.Msg.Keys[0].Id
	require.EqualValues(t, 100, kl.Msg.Keys[0].GetLimits().GetRpmLimit(), "the limit typed in the form")
	waitProxy(t, st.ProxyURL, keyTok, http.StatusOK, "the new key")
	b.page("overview")
	b.page("keys")
	require.NotContains(t, b.eval(`document.documentElement.outerHTML`), keyTok, "the token is shown only once")
	require.Contains(t, b.text(`tr[data-id="`+keyID+`"]`), alias)

	// Block it: the proxy refuses it. Unblock: it works again.
	b.do("block the key", chromedp.Click(chromedp.CSS(`tr[data-id="`+keyID+`"] button[data-test="block"]`)),
		chromedp.WaitVisible(chromedp.CSS(`body[data-ready="keys"] tr[data-id="`+keyID+`"] .blocked`)))
	waitProxy(t, st.ProxyURL, keyTok, http.StatusForbidden, "the blocked key")
	b.do("unblock the key", chromedp.Click(chromedp.CSS(`tr[data-id="`+keyID+`"] button[data-test="block"]`)),
		chromedp.WaitNotPresent(chromedp.CSS(`tr[data-id="`+keyID+`"] .blocked`)))
	waitProxy(t, st.ProxyURL, keyTok, http.StatusOK, "the unblocked key")

	// Rotate with an hour's grace: the new token works and so does the old.
	b.do("rotate the key", chromedp.SendKeys(chromedp.CSS(`tr[data-id="`+keyID+`"] input.grace`), "1h"),
		chromedp.Click(chromedp.CSS(`tr[data-id="`+keyID+`"] button[data-test="rotate"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#key-notice [data-test="token"]`)))
	newTok := strings.TrimSpace(b.text(`#key-notice [data-test="token"]`))
	require.NotEqual(t, keyTok, newTok)
	require.Contains(t, b.text(`#key-notice`), "stays valid until")
	waitProxy(t, st.ProxyURL, newTok, http.StatusOK, "the rotated key's new token")
	require.Equal(t, http.StatusOK, proxyStatus(t, st.ProxyURL, keyTok), "the old token within its grace")

	// Change its limits.
	b.do("edit the key's limits", chromedp.Click(chromedp.CSS(`tr[data-id="`+keyID+`"] button[data-test="limits"]`)),
		chromedp.WaitVisible(chromedp.CSS(`form[data-test="key-limits"]`)),
		chromedp.SetValue(chromedp.CSS(`form[data-test="key-limits"] input[name="rpmLimit"]`), "250"),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="key-limits"] input[name="maxBudget"]`), "5"),
		chromedp.SendKeys(chromedp.CSS(`form[data-test="key-limits"] input[name="budgetDuration"]`), "30d"),
		chromedp.Click(chromedp.CSS(`form[data-test="key-limits"] button[type="submit"]`)),
		chromedp.WaitNotPresent(chromedp.CSS(`form[data-test="key-limits"]`)))
	gk, err := keys.GetKey(ctx, connect.NewRequest(&adminv1.GetKeyRequest{Id: keyID}))
	require.NoError(t, err)
	require.EqualValues(t, 250, gk.Msg.Key.GetLimits().GetRpmLimit())
	require.EqualValues(t, 5, gk.Msg.Key.GetLimits().GetMaxBudget())
	require.Equal(t, "30d", gk.Msg.Key.GetLimits().GetBudgetDuration())

	// The spend plot is drawn from the ledger.
	b.page("spend")
	b.do("spend plots", chromedp.WaitVisible(chromedp.CSS(`svg[data-test="plot-key"] rect`)))
	require.Contains(t, b.text(`svg[data-test="plot-key"]`), "$")
	require.NotEqual(t, "0", b.eval(`String(document.querySelectorAll('svg[data-test="plot-key"] rect[data-series="human"]').length)`),
		"a bar for the demo key")
	require.Contains(t, b.text(`[data-test="spend-count"]`), "requests")
	burn := b.text(`table[data-test="burn"]`)
	require.Contains(t, burn, "org demo", "the demo org's budget against its cap")
	require.Contains(t, burn, "key "+alias, "the key's new budget")

	// The audit log verifies for the org.
	b.page("audit")
	b.do("verify the audit chain", chromedp.Click(chromedp.CSS(`button[data-test="verify"]`)),
		chromedp.WaitVisible(chromedp.CSS(`[data-test="verify-result"] .ok`)))

	// A team viewer sees its team's keys, no org-level pages and no
	// buttons that change anything.
	teamTok, err := tokens.CreateAdminToken(ctx, connect.NewRequest(&adminv1.CreateAdminTokenRequest{
		Name: "console-team-viewer", Scope: adminv1.Scope_SCOPE_TEAM, OrgId: st.OrgID, TeamId: st.TeamID, Role: adminv1.Role_ROLE_VIEWER}))
	require.NoError(t, err)
	tb := newBrowser(t, st.AdminURL+"/console/")
	tb.login(teamTok.Msg.Token)
	require.Equal(t, "overview,orgs,teams,keys,models,traffic,alerts,audit,spend,requests,explain",
		tb.eval(`[...document.querySelectorAll('#nav a')].map(a => a.dataset.page).join(',')`), "the pages a team token can use")
	tb.page("keys")
	require.Contains(t, tb.text(`table[data-test="keys"]`), alias)
	require.Equal(t, "0", tb.eval(`String(document.querySelectorAll('form[data-test="new-key"], button[data-test="block"], button[data-test="rotate"]').length)`),
		"a viewer is shown no way to change keys")

	if dir := os.Getenv(screenshotsEnv); dir != "" {
		require.NoError(t, os.MkdirAll(dir, 0o755))
		for _, p := range []string{"overview", "orgs", "teams", "users", "keys", "customers", "models", "alerts", "audit", "spend"} {
			b.page(p)
			b.screenshot(dir, "org-"+p)
		}
		tb.page("keys")
		tb.screenshot(dir, "team-viewer-keys")
		pb := newBrowser(t, st.AdminURL+"/console/")
		pb.login(st.AdminToken)
		for _, p := range []string{"overview", "orgs", "keys", "models", "fleet", "spend"} {
			pb.page(p)
			if p == "spend" {
				pb.do("spend plots", chromedp.WaitVisible(chromedp.CSS(`svg[data-test="plot-key"] rect`)))
			}
			pb.screenshot(dir, "platform-"+p)
		}
		t.Logf("console screenshots in %s", dir)
	}
}
