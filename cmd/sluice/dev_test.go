package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/sluicegw/sluice/internal/testsvc"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// syncBuffer is a bytes.Buffer safe for the loggers of both planes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// devRun is one `sluice dev` run.
type devRun struct {
	state  devState
	logs   *syncBuffer
	out    *syncBuffer // stdout: progress and the banner
	cancel context.CancelFunc
	done   chan error
}

// startDev runs `sluice dev` on dbURL with its state under dir and waits
// for its state file.
func startDev(t *testing.T, dir, dbURL, redisPrefix string) *devRun {
	t.Helper()
	stateFile := filepath.Join(dir, "dev.json")
	require.NoError(t, os.Remove(stateFile), "a previous run's state file") // written again when seeded
	ctx, cancel := context.WithCancel(context.Background())
	r := &devRun{logs: &syncBuffer{}, out: &syncBuffer{}, cancel: cancel, done: make(chan error, 1)}
	args := []string{"--database-url", dbURL, "--state-file", stateFile, "--addr", "127.0.0.1:0", "--proxy-addr", "127.0.0.1:0",
		"--nats-port", strconv.Itoa(freePort(t)), "--redis-url", "redis://127.0.0.1:6379/0", "--redis-key-prefix", redisPrefix, "--log-file", "-"}
	go func() { r.done <- runDev(ctx, args, func(string) string { return "" }, r.out, r.logs) }()
	t.Cleanup(func() { r.stop(t) })
	deadline := time.Now().Add(60 * time.Second)
	for {
		b, err := os.ReadFile(stateFile)
		if err == nil {
			require.NoError(t, json.Unmarshal(b, &r.state))
			return r
		}
		require.ErrorIs(t, err, os.ErrNotExist)
		select {
		case err := <-r.done:
			t.Fatalf("sluice dev ended before writing its state: %v\n%s", err, r.logs.String())
		default:
		}
		require.False(t, time.Now().After(deadline), "sluice dev wrote no state file within 60 s:\n%s", r.logs.String())
		time.Sleep(50 * time.Millisecond)
	}
}

// TestDevRestartKeepsKeys: a second `sluice dev` on the same database and
// state directory prints the same demo keys, which still authenticate; the
// banner comes last, names the console and logs in without a token on
// the command line; stopping returns no error.
func TestDevRestartKeepsKeys(t *testing.T) {
	dir := t.TempDir()
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "devtest-" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() { cleanRedis(t, prefix) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dev.json"), []byte("{}"), 0o600))
	db := testsvc.NewDatabase(t)

	first := startDev(t, dir, db, prefix)
	first.authenticates(t, first.state.Keys["human"], 15*time.Second)
	first.stop(t)
	require.Contains(t, first.out.String(), "new this run")

	second := startDev(t, dir, db, prefix)
	require.Equal(t, first.state.Keys, second.state.Keys, "the demo keys survive a restart")
	second.authenticates(t, second.state.Keys["human"], 15*time.Second)
	second.authenticates(t, second.state.Keys["agent"], time.Second)
	out := waitFor(t, second.out, "Press Ctrl-C")
	require.Contains(t, out, "the same as last run")
	require.Contains(t, out, second.state.AdminURL+"/console/")
	require.Contains(t, out, `SLUICE_TOKEN="$(cat `+filepath.Join(dir, "admin-token")+`)" ./bin/sluicectl login --server `+second.state.AdminURL)
	require.NotContains(t, out, second.state.AdminToken, "the admin token is not printed")
	// The agents' protocols are advertised with what to paste, and served.
	require.Contains(t, out, "ANTHROPIC_BASE_URL="+second.state.ProxyURL+" ANTHROPIC_AUTH_TOKEN="+second.state.Keys["agent"])
	require.Contains(t, out, "curl -s "+second.state.ProxyURL+"/v1/messages -H 'x-api-key: "+second.state.Keys["agent"]+"'")
	require.Contains(t, out, "OPENAI_BASE_URL="+second.state.ProxyURL+"/v1 OPENAI_API_KEY="+second.state.Keys["agent"])
	req, _ := http.NewRequest(http.MethodPost, second.state.ProxyURL+"/v1/messages",
		strings.NewReader(`{"model":"`+devModel+`","max_tokens":16,"messages":[{"role":"user","content":"Hello!"}]}`))
	req.Header.Set("x-api-key", second.state.Keys["agent"])
	req.Header.Set("anthropic-version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "/v1/messages on the demo pool: %s", msg)
	require.Contains(t, string(msg), `"type":"message"`)
	tok, err := os.ReadFile(filepath.Join(dir, "admin-token"))
	require.NoError(t, err)
	require.Equal(t, second.state.AdminToken+"\n", string(tok))
	second.stop(t)
}

// waitFor waits until b contains s and returns its text.
func waitFor(t *testing.T, b *syncBuffer, s string) string {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(b.String(), s) {
		require.False(t, time.Now().After(deadline), "no %q in:\n%s", s, b.String())
		time.Sleep(20 * time.Millisecond)
	}
	return b.String()
}

func (r *devRun) stop(t *testing.T) {
	if r.cancel == nil {
		return
	}
	r.cancel()
	r.cancel = nil
	select {
	case err := <-r.done:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("sluice dev did not stop within 60 s")
	}
}

// authenticates waits until the proxy accepts tok (GET /v1/auth/check)
// and answers a chat completion with it.
func (r *devRun) authenticates(t *testing.T, tok string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	var status int
	var body string
	for {
		req, _ := http.NewRequest(http.MethodGet, r.state.ProxyURL+"/v1/auth/check", nil)
		req.Header.Set("Authorization", "Bearer "+tok)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		status, body = resp.StatusCode, string(b)
		if status == http.StatusOK {
			break
		}
		require.False(t, time.Now().After(deadline), "the proxy answers %d %s for the demo key after %s; logs:\n%s", status, body, within, r.logs.String())
		time.Sleep(20 * time.Millisecond)
	}
	// A 503 (limits store slow to answer on a loaded machine) is retried
	// until the deadline; any other answer than 200 fails at once.
	for {
		req, _ := http.NewRequest(http.MethodPost, r.state.ProxyURL+"/v1/chat/completions",
			strings.NewReader(`{"model":"`+devModel+`","messages":[{"role":"user","content":"Hello!"}],"max_tokens":8}`))
		req.Header.Set("Authorization", "Bearer "+tok)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusServiceUnavailable && time.Now().Before(deadline.Add(10*time.Second)) {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		require.Equal(t, http.StatusOK, resp.StatusCode, "chat completion: %s", b)
		return
	}
}

// TestDevTwiceWithAnotherDatabase: `sluice dev` started twice with the
// same state directory (its JetStream store) and different databases.
// The second run's control plane finds JetStream ahead of its empty
// database, says so, and numbers above it: the demo key it creates
// authenticates through the proxy.
func TestDevTwiceWithAnotherDatabase(t *testing.T) {
	dir := t.TempDir()
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "devtest-" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() { cleanRedis(t, prefix) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dev.json"), []byte("{}"), 0o600))

	first := startDev(t, dir, testsvc.NewDatabase(t), prefix)
	first.authenticates(t, first.state.Keys["human"], 15*time.Second)
	first.stop(t)
	for line := range strings.Lines(first.logs.String()) {
		if strings.Contains(line, "bucket not found") {
			require.NotContains(t, line, "level=WARN", "no warning about buckets the control plane is about to create")
		}
	}

	second := startDev(t, dir, testsvc.NewDatabase(t), prefix)
	require.NotEqual(t, first.state.OrgID, second.state.OrgID, "the second database has its own demo org")
	second.authenticates(t, second.state.Keys["human"], 15*time.Second)
	second.authenticates(t, second.state.Keys["agent"], time.Second)
	logs := second.logs.String()
	require.Contains(t, logs, "started a new distribution epoch", "the control plane explains why versions jump")
	require.NotContains(t, logs, "snapshot rejected", "the proxy never refused the new database's snapshots")
	second.stop(t)
}

func cleanRedis(t *testing.T, prefix string) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	iter := rdb.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		rdb.Del(ctx, iter.Val())
	}
	if err := iter.Err(); err != nil && !errors.Is(err, context.Canceled) {
		t.Logf("clean redis prefix %s: %v", prefix, err)
	}
}

// TestDevSharedPool: the demo fleet is one pool. Both demo keys use the
// same model group on the same two engines; the agent key's requests are
// classed agent (kept out of the interactive reserve and behind people in
// the queue), the human key's interactive; each deployment declares the
// engine's max_num_seqs and an interactive reserve, with engine priority.
func TestDevSharedPool(t *testing.T) {
	dir := t.TempDir()
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "devtest-" + hex.EncodeToString(b[:]) + ":"
	t.Cleanup(func() { cleanRedis(t, prefix) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "dev.json"), []byte("{}"), 0o600))
	r := startDev(t, dir, testsvc.NewDatabase(t), prefix)
	r.authenticates(t, r.state.Keys["human"], 15*time.Second)
	r.authenticates(t, r.state.Keys["agent"], 15*time.Second)
	require.Len(t, r.state.Engines, 2)

	opt := connect.WithInterceptors(bearerAuth(r.state.AdminToken))
	models := adminv1connect.NewModelServiceClient(http.DefaultClient, r.state.AdminURL, opt)
	traffic := adminv1connect.NewTrafficServiceClient(http.DefaultClient, r.state.AdminURL, opt)
	dl, err := models.ListDeployments(context.Background(), connect.NewRequest(&adminv1.ListDeploymentsRequest{ModelGroup: devModel}))
	require.NoError(t, err)
	require.Len(t, dl.Msg.Deployments, 2, "one deployment per engine, one model group")
	engines := map[string]bool{}
	for _, d := range dl.Msg.Deployments {
		engines[strings.TrimSuffix(d.ApiBase, "/v1")] = true
		require.EqualValues(t, devEngineSeqs, d.MaxConcurrency)
		tr, err := traffic.GetDeploymentTraffic(context.Background(), connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: d.Id}))
		require.NoError(t, err)
		require.EqualValues(t, devReserve, tr.Msg.Traffic.GetInteractiveReserve())
		require.True(t, tr.Msg.Traffic.GetPriorityScheduling())
	}
	for _, u := range r.state.Engines {
		require.True(t, engines[u], "engine %s serves the pool", u)
	}
	gt, err := traffic.GetModelGroupTraffic(context.Background(), connect.NewRequest(&adminv1.GetModelGroupTrafficRequest{ModelGroup: devModel}))
	require.NoError(t, err)
	require.EqualValues(t, devPrefillIsolation, gt.Msg.GetTraffic().GetPrefillIsolation(), "one engine kept free of agent prefill")
	for alias, class := range map[string]string{"human": "interactive", "agent": "agent"} {
		req, _ := http.NewRequest(http.MethodPost, r.state.ProxyURL+"/v1/chat/completions",
			strings.NewReader(`{"model":"`+devModel+`","messages":[{"role":"user","content":"Hello!"}],"max_tokens":4}`))
		req.Header.Set("Authorization", "Bearer "+r.state.Keys[alias])
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, alias)
		require.Equal(t, class, resp.Header.Get("X-Sluice-Traffic-Class"), alias)
	}
	out := waitFor(t, r.out, "Press Ctrl-C")
	require.Contains(t, out, "make dev-load")
	r.stop(t)
}
