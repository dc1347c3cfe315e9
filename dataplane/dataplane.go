// Package dataplane runs a Sluice data-plane proxy (SPEC §2, §6, §7): it
// keeps its region's configuration current from NATS JetStream, never
// talks to Postgres, and authenticates virtual keys from memory.
//
// Config, New and Run are its exported surface.
package dataplane

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	configv1 "github.com/sluicegw/sluice/proto/gen/sluice/config/v1"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/sluicegw/sluice/dataplane/internal/admission"
	"github.com/sluicegw/sluice/dataplane/internal/affinity"
	"github.com/sluicegw/sluice/dataplane/internal/authn"
	"github.com/sluicegw/sluice/dataplane/internal/catalog"
	"github.com/sluicegw/sluice/dataplane/internal/configsync"
	"github.com/sluicegw/sluice/dataplane/internal/gateway"
	"github.com/sluicegw/sluice/dataplane/internal/limits"
	"github.com/sluicegw/sluice/dataplane/internal/redisconn"
	"github.com/sluicegw/sluice/dataplane/internal/respstore"
	"github.com/sluicegw/sluice/dataplane/internal/usage"
	"github.com/sluicegw/sluice/internal/keyring"
	"github.com/sluicegw/sluice/internal/token"
)

// DataPlane is one proxy instance.
type DataPlane struct {
	cfg                                             Config
	log                                             *slog.Logger
	nc                                              *nats.Conn
	sync                                            *configsync.Syncer
	peppers                                         *token.Peppers
	jwks                                            *authn.JWKS
	ln                                              net.Listener
	srv                                             *http.Server
	inFlight                                        atomic.Int64
	openConns                                       atomic.Int64
	authOK, authDenied, authRejected, staleRejected atomic.Int64
	// usage publishes one usage event per request (the proxy's UsageSink).
	usage *usage.Publisher
	// registry holds every metric /metrics exposes.
	registry *prometheus.Registry
	// proxy serves the OpenAI endpoints.
	proxy *gateway.Handler
	// lim is the limiter; its slice worker runs under Run (quota slices).
	lim *limits.Limiter
	// rdb is the limits store; alerts publishes budget alerts; fleet
	// counts the region's live data planes (local rpm/tpm fallback).
	rdb       *redisconn.Conn
	redisUp   *redisconn.Probe
	seeds     *seedClient
	alerts    *alertPublisher
	fleetSub  *nats.Subscription
	bootstrap func(orgs, deployments []string)
	// explainSub answers the region's explain requests (explain.go).
	explainSub *nats.Subscription
}

// New validates cfg, connects to NATS (retrying in the background if it
// is down) and binds the listener.
func New(ctx context.Context, cfg Config) (*DataPlane, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("invalid configuration:\n%w", err)
	}
	if cfg.InstanceID == "" {
		host, _ := os.Hostname()
		var b [3]byte
		_, _ = rand.Read(b[:])
		cfg.InstanceID = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	peppers, _ := token.ParsePeppers(cfg.KeyPepper)
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("sluice-proxy "+cfg.InstanceID), nats.MaxReconnects(-1),
		nats.ReconnectWait(200*time.Millisecond), nats.RetryOnFailedConnect(true), nats.PingInterval(2*time.Second),
		nats.MaxPingsOutstanding(2))
	if err != nil {
		return nil, fmt.Errorf("connect nats: %w", err)
	}
	d := &DataPlane{cfg: cfg, log: log, nc: nc, peppers: peppers}

	batchEvents := cfg.UsageBatchEvents
	if batchEvents == 0 {
		batchEvents = DefaultUsageBatchEvents
	}
	d.usage, err = usage.New(usage.Config{Region: cfg.Region, BufferSize: cfg.UsageBufferSize, BatchEvents: batchEvents,
		SpoolDir: cfg.UsageSpoolDir, Logger: log}, nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	d.seeds = &seedClient{nc: nc}
	lim, rdb, err := limitsSetup(&cfg, d.seeds.seeds)
	if err != nil {
		nc.Close()
		return nil, err
	}
	d.rdb = rdb
	aff, err := affinity.New(affinity.Config{Conn: rdb, KeyPrefix: cfg.RedisKeyPrefix, CallTimeout: affinityCallTimeout(cfg.LimitsCallTimeout)})
	if err != nil {
		d.closeClients()
		return nil, err
	}
	d.redisUp = redisconn.NewProbe(rdb, 0, 0)
	d.bootstrap = bootstrapEpochs(lim, log)
	d.lim = lim
	var beforeFirst func(*catalog.Catalog)
	if cfg.SoleDataPlane {
		beforeFirst = d.bootstrapAll
	}
	d.sync, err = configsync.New(configsync.Config{
		Region: cfg.Region, InstanceID: cfg.InstanceID, MaxStaleness: cfg.MaxStaleness,
		HeartbeatInterval: cfg.HeartbeatInterval, MaxRejecting: cfg.MaxRejecting, InFlight: d.inFlight.Load, Logger: log, Open: credentialOpener(cfg.KEK, log),
		Ejected: d.ejected, Backlog: d.backlog,
		OnCreate: d.bootstrap, BeforeFirst: beforeFirst,
	}, nc)
	if err != nil {
		d.closeClients()
		return nil, err
	}
	d.registry = prometheus.NewRegistry()
	d.registerMetrics()
	if d.alerts, err = newAlertPublisher(nc, cfg.Region, log); err != nil {
		d.closeClients()
		return nil, err
	}
	// The local rpm/tpm fallback is always ready: levels may ask for it
	// (rate_limit_fallback "local") even when the default is closed.
	hb := cfg.HeartbeatInterval
	if hb == 0 {
		hb = configsync.DefaultHeartbeatInterval
	}
	fv, sub, err := newFleetView(nc, cfg.Region, cfg.InstanceID, hb)
	if err != nil {
		d.closeClients()
		return nil, fmt.Errorf("subscribe to heartbeats: %w", err)
	}
	d.fleetSub = sub
	fallback := limits.NewLocalLimiter(fv.Live)
	if d.jwks, err = authn.NewJWKS(authn.JWKSConfig{MaxStale: cfg.JWKSMaxStale, RefreshInterval: cfg.JWKSRefreshInterval, Logger: log}); err != nil {
		d.closeClients()
		return nil, err
	}
	var responses gateway.ResponseStore
	if rdb != nil {
		responses = respstore.New(rdb, cfg.RedisKeyPrefix, respstore.DefaultTTL)
	}
	bounds, err := admission.ParseBounds(cfg.AdmissionQueues) // checked by Config's validation
	if err != nil {
		d.closeClients()
		return nil, err
	}
	d.proxy, err = gateway.New(gateway.Config{AdmissionQueues: bounds, AdmissionRetryInterval: cfg.AdmissionRetryInterval, Releases: natsReleases{nc: nc, log: log}, Catalog: d.sync.Catalog, Gate: d.gate, Peppers: peppers, Usage: d.usage, JWT: &authn.JWT{Keys: d.jwks},
		Registerer: d.registry, Region: cfg.Region, InstanceID: cfg.InstanceID, MaxBodyBytes: cfg.MaxBodyBytes,
		RequestTimeout: cfg.RequestTimeout, MaxRetries: cfg.MaxRetries, NoRetries: cfg.NoRetries, Logger: log,
		TTFTTimeout: cfg.TTFTTimeout, NoTTFTTimeout: cfg.NoTTFTTimeout, RetryBudgetRatio: cfg.RetryBudgetRatio, RetryBudgetMin: cfg.RetryBudgetMin,
		MaxEjectionPercent: cfg.MaxEjectionPercent, ParkMax: cfg.ParkMax,
		EjectionBase: cfg.EjectionBase, EjectionMax: cfg.EjectionMax, PanicThresholdPercent: cfg.PanicThresholdPercent,
		NoStreamProbation:   cfg.NoStreamProbation,
		HealthCheckInterval: cfg.HealthCheckInterval, HealthCheckTimeout: cfg.HealthCheckTimeout,
		HealthCheckUnhealthy: cfg.HealthCheckUnhealthy, HealthCheckHealthy: cfg.HealthCheckHealthy, NoHealthChecks: cfg.NoHealthChecks,
		EngineMetricsInterval: cfg.EngineMetricsInterval, EngineMetricsMaxAge: cfg.EngineMetricsMaxAge, NoEngineMetrics: cfg.NoEngineMetrics,
		BodyReadTimeout: cfg.BodyReadTimeout, MaxBodyReads: cfg.MaxBodyReads, MaxBodyReadsPerConn: cfg.MaxBodyReadsPerConn,
		Limiter: lim, RateFallback: fallback, RateFallbackDefault: cfg.RateLimitFallback == RateFallbackLocal, IETFRateLimitHeaders: cfg.IETFRateLimitHeaders, ProfileLabels: cfg.ProfileLabels, Alerts: d.alerts, DefaultMaxOutputTokens: cfg.DefaultMaxOutputTokens,
		Affinity: aff, Responses: responses})
	if err != nil {
		d.closeClients()
		return nil, err
	}
	if d.explainSub, err = d.subscribeExplain(); err != nil {
		d.closeClients()
		return nil, fmt.Errorf("subscribe to explain requests: %w", err)
	}
	d.ln, err = net.Listen("tcp", cfg.Addr)
	if err != nil {
		d.closeClients()
		return nil, fmt.Errorf("listen on %s: %w", cfg.Addr, err)
	}
	d.srv = d.newServer(d.routes())
	return d, nil
}

// errNoKeyRing is the credential error of every deployment with a
// credential on a data plane started without SLUICE_KEK.
var errNoKeyRing = errors.New("no key ring configured (SLUICE_KEK) to decrypt the credential")

// credentialOpener returns the function the catalog decrypts deployment
// credentials with. Every failure is logged as an error (never the
// ciphertext or the plaintext): the catalog marks the deployment
// unavailable (CredentialErr), and an operator must hear about it.
func credentialOpener(kek string, log *slog.Logger) catalog.OpenFunc {
	var ring *keyring.Ring
	if strings.TrimSpace(kek) != "" {
		ring, _ = keyring.Parse(kek) // validated by Config.Validate
	}
	return func(ct []byte) ([]byte, error) {
		if ring == nil {
			log.Error("deployment credential cannot be decrypted: no key ring configured (SLUICE_KEK); the deployment is unavailable",
				"key_version", keyVersion(ct))
			return nil, errNoKeyRing
		}
		pt, err := ring.Open(ct)
		if err != nil {
			log.Error("deployment credential cannot be decrypted; the deployment is unavailable",
				"key_version", keyVersion(ct), "current_key_version", ring.Current(), "error", err)
			return nil, err
		}
		return pt, nil
	}
}

// keyVersion returns the key version a ciphertext names ("v2"), or "".
func keyVersion(ct []byte) string {
	v, _, ok := strings.Cut(string(ct[:min(len(ct), 12)]), ":")
	if !ok || !strings.HasPrefix(v, "v") {
		return ""
	}
	return v
}

// Addr returns the bound HTTP address.
func (d *DataPlane) Addr() string { return d.ln.Addr().String() }

// bootstrapAll bootstraps the limits epochs of every org and deployment of
// the first catalog, before it serves (Config.SoleDataPlane).
func (d *DataPlane) bootstrapAll(cat *catalog.Catalog) {
	var deps []string
	for _, dep := range cat.AllDeployments() {
		deps = append(deps, dep.GetId())
	}
	orgs := cat.OrgIDs()
	d.bootstrap(orgs, deps)
	d.log.Info("limits epochs bootstrapped (sole data plane)", "orgs", len(orgs), "deployments", len(deps))
}

func (d *DataPlane) closeClients() {
	if d.rdb != nil {
		_ = d.rdb.Close()
	}
	d.nc.Close()
}

// Run serves until ctx is done or a component fails, and returns that
// component's error (nil after a clean shutdown).
//
// The components run under an errgroup, each with the stop context of its
// layer, so that shutdown goes in order whatever ended the run: the HTTP
// server stops first (its in-flight requests finish and queue their
// settlements and usage events), then the settlements are drained while
// the settlement worker still runs, then config sync, the sweeper and the
// settlement worker stop, and last the usage and alert publishers (they
// take the events and alerts of everything before them).
func (d *DataPlane) Run(ctx context.Context) error {
	defer d.closeClients()
	base := context.WithoutCancel(ctx)
	early, stopEarly := context.WithCancel(base) // sync, sweeper, settler
	late, stopLate := context.WithCancel(base)   // usage and alert publishers
	defer stopEarly()
	defer stopLate()
	g, failed := errgroup.WithContext(ctx)
	component := func(name string, c context.Context, run func(context.Context) error) {
		g.Go(func() error {
			if err := run(c); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	component("budget alerts", late, d.alerts.Run)
	component("usage publisher", late, d.usage.Run)
	component("config sync", early, d.sync.Run)
	component("lease sweeper", early, d.proxy.RunSweeper)
	component("jwks refresh", early, d.jwks.Run)
	component("limits settlement", early, d.proxy.RunSettler)
	component("limits slices", early, d.lim.RunSlices)
	component("redis probe", early, d.redisUp.Run)
	component("health checks", early, d.proxy.RunHealthChecks)
	component("engine metrics", early, d.proxy.RunEngineMetrics)
	g.Go(func() error {
		if err := d.srv.Serve(d.ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("http server: %w", err)
		}
		return nil
	})
	d.log.Info("data plane serving", "addr", d.Addr(), "region", d.cfg.Region, "instance", d.cfg.InstanceID)
	<-failed.Done() // ctx ended, or a component failed

	shutdown, cancel := context.WithTimeout(base, 10*time.Second)
	defer cancel()
	var errs []error
	if err := d.srv.Shutdown(shutdown); err != nil {
		errs = append(errs, fmt.Errorf("shutdown: %w", err))
	}
	// Settlements of the last requests (leases, tpm, budgets) before the
	// Redis client closes.
	if derr := d.proxy.Drain(shutdown); derr != nil {
		d.log.Error("limits settlements still pending at shutdown; their leases expire by TTL", "error", derr)
	}
	stopEarly()
	stopLate()
	// The first component error (the one that stopped the plane), if any,
	// comes first.
	if err := g.Wait(); err != nil {
		errs = append([]error{err}, errs...)
	}
	return errors.Join(errs...)
}

// ejected lists the deployments out of the proxy's rotation for the
// heartbeat (nil before the proxy exists).
func (d *DataPlane) ejected() []*configv1.EjectedDeployment {
	if d.proxy == nil {
		return nil
	}
	return d.proxy.Ejected()
}

// backlog is the admission backlog per class for the heartbeat (nil
// before the proxy exists).
func (d *DataPlane) backlog() []*configv1.AdmissionBacklog {
	if d.proxy == nil {
		return nil
	}
	return d.proxy.AdmissionBacklog()
}
