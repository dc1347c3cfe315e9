package system

import (
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/harness"

	"connectrpc.com/connect"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/internal/keyring"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"github.com/sluicegw/sluice/proto/wire"
)

// logSink collects a data plane's log lines.
type logSink struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *logSink) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logSink) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// startProxyKEK starts a data plane of region "default" with its own key
// ring (kek "" for none) and returns it with its captured logs.
func (d *dist) startProxyKEK(kek string) (*proxy, *logSink) {
	d.T.Helper()
	logs := &logSink{}
	return d.StartProxyConfig(dataplane.Config{Region: "default", NATSURL: d.NATS.URL, Addr: "127.0.0.1:0", KeyPepper: testPepper, KEK: kek, RedisKeyPrefix: d.RedisPrefix,
		MaxStaleness: time.Minute, HeartbeatInterval: 200 * time.Millisecond,
		Logger: slog.New(slog.NewJSONHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))}), logs
}

func (d *dist) modelClient() adminv1connect.ModelServiceClient {
	return adminv1connect.NewModelServiceClient(http.DefaultClient, d.Admin, connect.WithInterceptors(harness.BearerInterceptor(testBootstrap)))
}

// deployment waits until p's catalog has deployment id (or, with gone,
// no longer has it) and returns it.
func deployment(t *testing.T, p *proxy, id string, ok func(*dataplane.Deployment) bool) *dataplane.Deployment {
	t.Helper()
	var got *dataplane.Deployment
	harness.Eventually(t, func() bool {
		got = nil
		for _, dep := range p.DP.Catalog().AllDeployments() {
			if dep.GetId() == id {
				got = dep
			}
		}
		return ok(got)
	}, 10*time.Second, 10*time.Millisecond, "deployment %s never reached the wanted state on %s", id, p.URL)
	return got
}

func present(d *dataplane.Deployment) bool { return d != nil }

// TestDeploymentsReachDataPlanesWithCredentials: a deployment created
// through the admin API reaches every data plane's catalog; the credential
// travels sealed and opens only with the same key ring. A data plane with
// another ring (or none) has the deployment with CredentialErr set and
// logs an error, never the plaintext.
func TestDeploymentsReachDataPlanesWithCredentials(t *testing.T) {
	t.Parallel()
	d := startDist(t)
	ctx := context.Background()
	m := d.modelClient()
	const secret = "sk-upstream-secret-0123456789"
	_, err := m.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{Name: "qwen-30b", PlatformWide: true}))
	require.NoError(t, err)
	mk := func(cred string, tags ...string) string {
		t.Helper()
		r, err := m.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
			ModelGroup: "qwen-30b", ApiBase: "http://vllm-a:8000/v1", UpstreamModel: "Qwen/Qwen3-30B-A3B", Credential: cred,
			Weight: 3, MaxConcurrency: 16, Tags: tags, Capabilities: &adminv1.Capabilities{Tools: true, MaxOutputTokens: 4096},
			Prices: &adminv1.Prices{InputPerToken: 2e-7, OutputPerToken: 8e-7, CachedInputPerToken: 1e-7},
		}))
		require.NoError(t, err)
		return r.Msg.Deployment.Id
	}
	withCred := mk(secret, "interactive")
	noCred := mk("")

	good := d.StartProxy("default", time.Minute)
	wrong, wrongLogs := d.startProxyKEK("1:d3Jvbmcta2V5LXJpbmctMDEyMzQ1Njc4OWFiY2RlZmc=")
	none, noneLogs := d.startProxyKEK("")

	dep := deployment(t, good, withCred, present)
	require.NoError(t, dep.CredentialErr)
	require.Equal(t, secret, dep.Credential)
	require.Equal(t, "qwen-30b", dep.GetModelGroup())
	require.Equal(t, "http://vllm-a:8000/v1", dep.GetApiBase())
	require.Equal(t, "Qwen/Qwen3-30B-A3B", dep.GetUpstreamModel())
	require.EqualValues(t, 3, dep.GetWeight())
	require.EqualValues(t, 16, dep.GetMaxConcurrency())
	require.True(t, dep.GetCapabilities().GetTools())
	require.EqualValues(t, 4096, dep.GetCapabilities().GetMaxOutputTokens())
	require.Equal(t, []string{"interactive"}, dep.GetTags())
	require.Empty(t, cmp.Diff(&configv1.Prices{InputPerToken: 2e-7, OutputPerToken: 8e-7, CachedInputPerToken: 1e-7}, dep.GetPrices(), protocmp.Transform()))
	require.True(t, strings.HasPrefix(string(dep.GetCredentialCiphertext()), "v1:"), "the credential travels sealed")
	require.True(t, good.DP.Catalog().HasModelGroup("qwen-30b"))

	for _, p := range []struct {
		name string
		p    *proxy
		logs *logSink
		want string
	}{{"other key ring", wrong, wrongLogs, "does not open with key v1"}, {"no key ring", none, noneLogs, "no key ring configured (SLUICE_KEK)"}} {
		dep := deployment(t, p.p, withCred, present)
		require.Error(t, dep.CredentialErr, p.name)
		require.ErrorContains(t, dep.CredentialErr, p.want, p.name)
		require.Empty(t, dep.Credential, p.name)
		require.NoError(t, deployment(t, p.p, noCred, present).CredentialErr, "%s: a deployment without a credential is usable", p.name)
		harness.Eventually(t, func() bool {
			return strings.Contains(p.logs.String(), `"level":"ERROR","msg":"deployment credential cannot be decrypted`)
		}, 5*time.Second, 10*time.Millisecond, "%s: the failure is logged as an error:\n%s", p.name, p.logs.String())
		require.Contains(t, p.logs.String(), `"key_version":"v1"`)
		require.NotContains(t, p.logs.String(), secret)
	}

	// The snapshot itself carries the ciphertext as stored: sealed, and
	// opening with the control plane's ring.
	snap := latestSnapshot(t, d, func(s *configv1.Snapshot) bool { return len(s.GetDeployments()) == 2 })
	require.Equal(t, []*configv1.ModelGroup{{Name: "qwen-30b", PlatformWide: true}}, snap.GetModelGroups())
	ring, err := keyring.Parse(testKEK)
	require.NoError(t, err)
	for _, sd := range snap.GetDeployments() {
		if sd.GetId() != withCred {
			require.Empty(t, sd.GetCredentialCiphertext())
			continue
		}
		require.NotContains(t, string(sd.GetCredentialCiphertext()), secret)
		pt, err := ring.Open(sd.GetCredentialCiphertext())
		require.NoError(t, err)
		require.Equal(t, secret, string(pt))
	}

	// Changes arrive as events: a rotated credential, then a deletion.
	_, err = m.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
		Deployment: &adminv1.Deployment{Id: withCred, Weight: 9}, Credential: "sk-rotated", UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"weight", "credential"}}}))
	require.NoError(t, err)
	dep = deployment(t, good, withCred, func(d *dataplane.Deployment) bool { return d != nil && d.Credential == "sk-rotated" })
	require.EqualValues(t, 9, dep.GetWeight())
	_, err = m.DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: withCred}))
	require.NoError(t, err)
	_, err = m.DeleteDeployment(ctx, connect.NewRequest(&adminv1.DeleteDeploymentRequest{Id: noCred}))
	require.NoError(t, err)
	_, err = m.DeleteModelGroup(ctx, connect.NewRequest(&adminv1.DeleteModelGroupRequest{Name: "qwen-30b"}))
	require.NoError(t, err)
	for _, p := range []*proxy{good, wrong, none} {
		deployment(t, p, withCred, func(d *dataplane.Deployment) bool { return d == nil })
		harness.Eventually(t, func() bool { return !p.DP.Catalog().HasModelGroup("qwen-30b") }, 10*time.Second, 10*time.Millisecond)
	}
}

// latestSnapshot waits until region default's pointer names a snapshot
// for which ok holds, and returns it.
func latestSnapshot(t *testing.T, d *dist, ok func(*configv1.Snapshot) bool) *configv1.Snapshot {
	t.Helper()
	nc, err := nats.Connect(d.NATS.URL)
	require.NoError(t, err)
	defer nc.Close()
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	ctx := context.Background()
	var snap *configv1.Snapshot
	harness.Eventually(t, func() bool {
		kv, err := js.KeyValue(ctx, wire.PointerBucket)
		if err != nil {
			return false
		}
		e, err := kv.Get(ctx, wire.PointerKey("default"))
		if err != nil {
			return false
		}
		ptr := &configv1.SnapshotPointer{}
		if proto.Unmarshal(e.Value(), ptr) != nil {
			return false
		}
		obs, err := js.ObjectStore(ctx, wire.SnapshotBucket)
		if err != nil {
			return false
		}
		body, err := obs.GetBytes(ctx, ptr.GetObject())
		if err != nil {
			return false
		}
		snap, err = wire.DecodeSnapshot(body, ptr)
		return err == nil && ok(snap)
	}, 10*time.Second, 20*time.Millisecond, "no snapshot with the expected content")
	return snap
}
