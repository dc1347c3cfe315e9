package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"

	"github.com/sluicegw/sluice/controlplane"
	"github.com/sluicegw/sluice/dataplane"
	"github.com/sluicegw/sluice/e2e/vllmsim"
	"github.com/sluicegw/sluice/internal/keyring"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
	"github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"
)

// Defaults of `sluice dev`.
const (
	// devDatabase is the database `sluice dev` uses (created if missing).
	devDatabase       = "sluice_dev"
	devDatabaseURL    = "postgres://postgres@127.0.0.1:5432/" + devDatabase + "?sslmode=disable"
	devStateFile      = ".sluice/dev.json"
	devRedisKeyPrefix = "sluice-dev:"
	// devNATSPort is not NATS's usual 4222, so dev runs beside a local
	// NATS server.
	devNATSPort = 4223
)

// devEnvAliases are the variables `sluice dev` read before every flag had
// its SLUICE_<FLAG> one; still honoured.
var devEnvAliases = envAliases{"addr": "SLUICE_ADMIN_ADDR"}

// devState is written to --state-file for scripts and tests.
type devState struct {
	AdminURL   string            `json:"admin_url"`
	ProxyURL   string            `json:"proxy_url"`
	NATSURL    string            `json:"nats_url"`
	Engines    map[string]string `json:"engines"`
	AdminToken string            `json:"admin_token"`
	OrgID      string            `json:"org_id"`
	TeamID     string            `json:"team_id"`
	Keys       map[string]string `json:"keys"`

	demoKeys    map[string]demoKey // what the next run may reuse
	keysChanged bool               // a demo key was created or rotated
	// enginesMoved: an existing deployment was pointed at this run's
	// engine, which the proxy learns shortly after.
	enginesMoved bool
}

// devSecrets persist between `sluice dev` runs so issued tokens stay valid.
type devSecrets struct {
	AdminToken string `json:"admin_token"`
	KeyPepper  string `json:"key_pepper"`
	// KEK is the key ring sealing upstream credentials (SLUICE_KEK).
	KEK string `json:"kek"`
	// DemoKeys are the demo keys' tokens by alias, reused by the next run
	// while the key they belong to is unchanged (same database).
	DemoKeys map[string]demoKey `json:"demo_keys,omitempty"`
}

// demoKey is a demo key's token and the key it was issued for.
type demoKey struct {
	ID        string `json:"id"`
	Token     string `json:"token"`
	Rotations int64  `json:"rotations"`
}

func runDev(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sluice dev", flag.ContinueOnError)
	fs.SetOutput(stderr)
	addr := fs.String("addr", controlplane.DefaultAdminAddr, "admin API listen address")
	dbURL := fs.String("database-url", devDatabaseURL, "Postgres URL; the database is created if missing")
	stateFile := fs.String("state-file", devStateFile, "where to write URLs and tokens as JSON")
	proxyAddr := fs.String("proxy-addr", dataplane.DefaultAddr, "data-plane proxy listen address")
	redisURL := fs.String("redis-url", dataplane.DefaultRedisURL, "limits store")
	redisPrefix := fs.String("redis-key-prefix", devRedisKeyPrefix, "prefix of the data plane's limits keys")
	slicesOn := fs.Bool("limit-slices", true, "quota slices, as for sluice proxy (--limit-slices=false: exact per-request admission only)")
	ietfHeaders := fs.Bool("ietf-rate-limit-headers", false, "the IETF RateLimit and RateLimit-Policy fields on limited answers, as for sluice proxy")
	natsPort := fs.Int("nats-port", devNATSPort, "port of the embedded NATS server (JetStream data under .sluice/nats)")
	logFile := fs.String("log-file", "", "file for the planes' logs at --log-level; the terminal shows warnings and errors only. "+
		`"-" logs everything to stderr (default: dev.log next to --state-file)`)
	level, format := logFlags(fs, "text")
	if err := parseEnvFlags(fs, args, getenv, devEnvAliases); err != nil {
		return err
	}
	stateDir := filepath.Dir(*stateFile)
	if *logFile == "" {
		*logFile = filepath.Join(stateDir, "dev.log")
	}
	log, closeLog, err := devLogger(stderr, *logFile, *level, *format)
	if err != nil {
		return err
	}
	defer closeLog()
	if *logFile != "-" {
		fmt.Fprintf(stdout, "dev: logs go to %s (warnings and errors also here)\n", *logFile)
	}
	fmt.Fprintln(stdout, "dev: migrating the database and starting NATS, the control plane, a data plane and two simulated engines ...")
	if err := ensureDatabase(ctx, *dbURL); err != nil {
		return err
	}
	secretsFile := filepath.Join(stateDir, "dev-secrets.json")
	sec, err := loadDevSecrets(secretsFile, getenv)
	if err != nil {
		return err
	}
	ns, err := startDevNATS(filepath.Join(stateDir, "nats"), *natsPort)
	if err != nil {
		return err
	}
	defer func() { ns.Shutdown(); ns.WaitForShutdown() }()
	natsURL := ns.ClientURL()
	cp, err := controlplane.New(ctx, controlplane.Config{
		DatabaseURL: *dbURL, AdminAddr: *addr, NATSURL: natsURL, InstanceID: "dev-control",
		BootstrapToken: sec.AdminToken, KeyPepper: sec.KeyPepper, KEK: sec.KEK, Migrate: true, Logger: log,
	})
	if err != nil {
		return err
	}
	// Both planes run in one group: the first to stop (with an error, or
	// nil after ctx ends) stops the other, and every error is returned.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		defer cancel()
		if err := cp.Run(gctx); err != nil {
			return fmt.Errorf("control plane: %w", err)
		}
		return nil
	})
	// stop ends the planes after a setup error and returns it with
	// whatever the planes returned.
	stop := func(err error) error {
		cancel()
		return errors.Join(err, g.Wait())
	}
	dp, err := dataplane.New(gctx, dataplane.Config{
		Region: dataplane.DefaultRegion, InstanceID: "dev-proxy", NATSURL: natsURL, Addr: *proxyAddr,
		KeyPepper: sec.KeyPepper, KEK: sec.KEK, Logger: log, RedisURL: *redisURL, RedisKeyPrefix: *redisPrefix,
		NoLimitSlices:        !*slicesOn,
		IETFRateLimitHeaders: *ietfHeaders,
		SoleDataPlane:        true, // the only data plane of the dev fleet
	})
	if err != nil {
		return stop(err)
	}
	g.Go(func() error {
		defer cancel()
		if err := dp.Run(gctx); err != nil {
			return fmt.Errorf("data plane: %w", err)
		}
		return nil
	})
	engines, err := startDevEngines(log)
	if err != nil {
		return stop(err)
	}
	defer func() {
		for _, e := range engines {
			_ = e.Close()
		}
	}()

	adminURL := "http://" + cp.Addr()
	engineURLs := map[string]string{}
	for name, e := range engines {
		engineURLs[name] = e.URL()
	}
	fmt.Fprintln(stdout, "dev: seeding the demo org, team, users, keys and model groups through the admin API ...")
	st, err := seedDemo(gctx, adminURL, sec.AdminToken, engineURLs, sec.DemoKeys)
	st.ProxyURL, st.NATSURL, st.Engines = "http://"+dp.Addr(), natsURL, engineURLs
	if err != nil {
		return stop(fmt.Errorf("seed demo data: %w", err))
	}
	if st.enginesMoved {
		// Last run's engines are gone: wait until the proxy routes the demo
		// model to this run's, so the printed curl line works at once.
		fmt.Fprintln(stdout, "dev: waiting for the proxy to route to this run's engines ...")
		if err := waitDemoServed(gctx, st.ProxyURL, st.Keys["human"], 30*time.Second); err != nil {
			log.Warn("the demo model is not served yet", "error", err)
		}
	}
	tokenFile := filepath.Join(stateDir, "admin-token")
	err = writeJSONFile(*stateFile, st)
	if err == nil {
		err = saveDemoKeys(secretsFile, st.demoKeys)
	}
	if err == nil {
		err = writeSecretFile(tokenFile, sec.AdminToken)
	}
	if err != nil {
		return stop(err)
	}
	keysNote := "the same as last run (kept in " + secretsFile + ")"
	if st.keysChanged {
		keysNote = "new this run: the demo keys did not exist or changed since the last run"
	}
	fmt.Fprintf(stdout, `
============================================================================
Sluice dev is running.  Press Ctrl-C to stop.

  console      %s/console/   (log in with the admin token)
  admin token  in %s   (platform admin; SLUICE_ADMIN_TOKEN overrides)
  admin API    %s   (Connect RPC; JSON over HTTP/1.1 or h2c)
  proxy        %s   (OpenAI API, data plane of region "default")
  engines      %s  %s   (vllm-sim, one pool: model %q)
  nats         %s   (embedded, JetStream)
  demo org     %s
  keys         human=%s
               agent=%s
               %s
  logs         %s
  state file   %s

Try it:
  SLUICE_TOKEN="$(cat %s)" ./bin/sluicectl login --server %s
  ./bin/sluicectl key list

  curl -s %s/v1/chat/completions -H 'Authorization: Bearer %s' \
    -H 'Content-Type: application/json' \
    -d '{"model":"%s","messages":[{"role":"user","content":"Hello!"}],"max_tokens":32}'

Agents' protocols, same keys, limits and ledger (docs/protocols.md):
  /v1/messages   Anthropic Messages: Claude Code, the Anthropic SDKs
    ANTHROPIC_BASE_URL=%s ANTHROPIC_AUTH_TOKEN=%s \
      ANTHROPIC_MODEL=%s claude
    curl -s %s/v1/messages -H 'x-api-key: %s' \
      -H 'anthropic-version: 2023-06-01' -H 'Content-Type: application/json' \
      -d '{"model":"%s","max_tokens":32,"messages":[{"role":"user","content":"Hello!"}]}'
  /v1/responses  OpenAI Responses: Codex-style clients, openai-go client.Responses
    OPENAI_BASE_URL=%s/v1 OPENAI_API_KEY=%s   (model %q)

Both keys share the pool; the agent key is classed agent, so %d slots of
each engine stay free for people. A chat staying fast while agents run:
  make dev-load      (12 coding-agent loops on the agent key, chat probes on the human key)
============================================================================
`, adminURL, tokenFile, adminURL, st.ProxyURL, st.Engines[devEngines[0]], st.Engines[devEngines[1]], devModel, natsURL, st.OrgID,
		st.Keys["human"], st.Keys["agent"], keysNote, *logFile, *stateFile, tokenFile, adminURL, st.ProxyURL, st.Keys["human"], devModel,
		st.ProxyURL, st.Keys["agent"], devModel, st.ProxyURL, st.Keys["agent"], devModel, st.ProxyURL, st.Keys["agent"], devModel, devReserve)
	// Both planes stop before NATS does (deferred above), so the next run
	// finds its store complete.
	return g.Wait()
}

// waitDemoServed polls a one-token chat completion with key until the
// proxy answers 200.
func waitDemoServed(ctx context.Context, proxyURL, key string, within time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, within)
	defer cancel()
	body := `{"model":"` + devModel + `","messages":[{"role":"user","content":"ping"}],"max_tokens":1}`
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, proxyURL+"/v1/chat/completions", strings.NewReader(body))
		if err != nil {
			return err
		}
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("proxy answered %d", resp.StatusCode)
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// devLogger logs to path at level with warnings and errors also on
// stderr, or everything to stderr when path is "-".
func devLogger(stderr io.Writer, path, level, format string) (*slog.Logger, func(), error) {
	if path == "-" {
		log, err := newLogger(stderr, level, format)
		return log, func() {}, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, nil, err
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("log file: %w", err)
	}
	toFile, err := newLogger(f, level, format)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	toTerm, err := newLogger(stderr, "warn", format)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return slog.New(slog.NewMultiHandler(toFile.Handler(), toTerm.Handler())), func() { _ = f.Close() }, nil
}

// saveDemoKeys records the demo keys' tokens in the secrets file (only
// that field: secrets given by the environment stay out of the file).
func saveDemoKeys(path string, keys map[string]demoKey) error {
	var s devSecrets
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	s.DemoKeys = keys
	return writeJSONFile(path, s)
}

// writeSecretFile writes a secret (mode 0600) followed by a newline.
func writeSecretFile(path, secret string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(secret+"\n"), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// ensureDatabase creates the database of dbURL if it does not exist.
func ensureDatabase(ctx context.Context, dbURL string) error {
	u, err := url.Parse(dbURL)
	if err != nil {
		return fmt.Errorf("database URL does not parse")
	}
	name := strings.TrimPrefix(u.Path, "/")
	if name == "" || strings.ContainsAny(name, `"/ `) {
		return fmt.Errorf("database URL must name a database")
	}
	u.Path = "/postgres"
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		return fmt.Errorf("connect postgres (is it running? try deploy/local/services.sh): %w", err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return fmt.Errorf("check database: %w", err)
	}
	if exists {
		return nil
	}
	if _, err := conn.Exec(ctx, `CREATE DATABASE "`+name+`"`); err != nil {
		return fmt.Errorf("create database %s: %w", name, err)
	}
	return nil
}

// randomBase64 returns n random bytes in standard base64 (a key ring key).
func randomBase64(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// loadDevSecrets takes secrets from the environment, else from path,
// generating and saving them (mode 0600) on the first run.
func loadDevSecrets(path string, getenv func(string) string) (devSecrets, error) {
	var s devSecrets
	if b, err := os.ReadFile(path); err == nil {
		if err := json.Unmarshal(b, &s); err != nil {
			return s, fmt.Errorf("read %s: %w", path, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return s, err
	}
	changed := false
	if s.AdminToken == "" {
		s.AdminToken, changed = "dev-admin-"+randomHex(24), true
	}
	if s.KeyPepper == "" {
		s.KeyPepper, changed = "1:"+randomHex(32), true
	}
	if s.KEK == "" {
		s.KEK, changed = "1:"+randomBase64(keyring.KeySize), true
	}
	if changed {
		if err := writeJSONFile(path, s); err != nil {
			return s, err
		}
	}
	if v, err := secret(getenv, "SLUICE_ADMIN_TOKEN"); err != nil {
		return s, err
	} else if v != "" {
		s.AdminToken = v
	}
	if v, err := secret(getenv, "SLUICE_KEY_PEPPER"); err != nil {
		return s, err
	} else if v != "" {
		s.KeyPepper = v
	}
	if v, err := secret(getenv, "SLUICE_KEK"); err != nil {
		return s, err
	} else if v != "" {
		s.KEK = v
	}
	return s, nil
}

func writeJSONFile(path string, v any) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

type bearerAuth string

func (b bearerAuth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearerAuth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}
func (b bearerAuth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// seedDemo creates (or finds) the demo org, team, users and keys through
// the admin API, like any client would. A key that exists keeps the token
// of the last run (saved) while it is unchanged since; otherwise it is
// rotated so the printed token is valid.
func seedDemo(ctx context.Context, adminURL, adminToken string, engines map[string]string, saved map[string]demoKey) (devState, error) {
	hc := &http.Client{Timeout: 30 * time.Second}
	opt := connect.WithInterceptors(bearerAuth(adminToken))
	orgs := adminv1connect.NewOrgServiceClient(hc, adminURL, opt)
	teams := adminv1connect.NewTeamServiceClient(hc, adminURL, opt)
	users := adminv1connect.NewUserServiceClient(hc, adminURL, opt)
	keys := adminv1connect.NewKeyServiceClient(hc, adminURL, opt)
	models := adminv1connect.NewModelServiceClient(hc, adminURL, opt)
	traffic := adminv1connect.NewTrafficServiceClient(hc, adminURL, opt)
	st := devState{AdminURL: adminURL, AdminToken: adminToken, Keys: map[string]string{}, demoKeys: map[string]demoKey{}}
	moved, err := seedModels(ctx, models, traffic, engines)
	if err != nil {
		return st, err
	}
	st.enginesMoved = moved

	ol, err := orgs.ListOrgs(ctx, connect.NewRequest(&adminv1.ListOrgsRequest{NamePrefix: "demo"}))
	if err != nil {
		return st, err
	}
	for _, o := range ol.Msg.Orgs {
		if o.Name == "demo" {
			st.OrgID = o.Id
		}
	}
	if st.OrgID == "" {
		o, err := orgs.CreateOrg(ctx, connect.NewRequest(&adminv1.CreateOrgRequest{
			Name: "demo", Limits: &adminv1.Limits{MaxBudget: proto.Float64(100), BudgetDuration: "30d"},
		}))
		if err != nil {
			return st, err
		}
		st.OrgID = o.Msg.Org.Id
	}
	tl, err := teams.ListTeams(ctx, connect.NewRequest(&adminv1.ListTeamsRequest{OrgId: st.OrgID, NamePrefix: "platform"}))
	if err != nil {
		return st, err
	}
	for _, t := range tl.Msg.Teams {
		if t.Name == "platform" {
			st.TeamID = t.Id
		}
	}
	if st.TeamID == "" {
		t, err := teams.CreateTeam(ctx, connect.NewRequest(&adminv1.CreateTeamRequest{
			OrgId: st.OrgID, Name: "platform",
			Limits: &adminv1.Limits{RpmLimit: proto.Int64(600), MaxParallelRequests: proto.Int64(32)},
		}))
		if err != nil {
			return st, err
		}
		st.TeamID = t.Msg.Team.Id
	}
	userIDs := map[string]string{}
	for _, email := range []string{"alice@demo.example", "build-agent@demo.example"} {
		ul, err := users.ListUsers(ctx, connect.NewRequest(&adminv1.ListUsersRequest{OrgId: st.OrgID, EmailPrefix: email}))
		if err != nil {
			return st, err
		}
		for _, u := range ul.Msg.Users {
			if u.Email == email {
				userIDs[email] = u.Id
			}
		}
		if userIDs[email] == "" {
			u, err := users.CreateUser(ctx, connect.NewRequest(&adminv1.CreateUserRequest{OrgId: st.OrgID, Email: email}))
			if err != nil {
				return st, err
			}
			userIDs[email] = u.Msg.User.Id
			if _, err := teams.AddTeamMember(ctx, connect.NewRequest(&adminv1.AddTeamMemberRequest{TeamId: st.TeamID, UserId: u.Msg.User.Id})); err != nil {
				return st, err
			}
		}
	}
	demoKeys := []struct {
		alias, user string
		class       adminv1.TrafficClass
		limits      *adminv1.Limits
		aliases     map[string]string
	}{
		{"human", "alice@demo.example", adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE, &adminv1.Limits{RpmLimit: proto.Int64(600)}, nil},
		// The agent key shares the same pool: its class keeps it out of
		// the interactive reserve and behind people in the queue.
		{"agent", "build-agent@demo.example", adminv1.TrafficClass_TRAFFIC_CLASS_AGENT, &adminv1.Limits{MaxParallelRequests: proto.Int64(16)}, nil},
	}
	for _, k := range demoKeys {
		kl, err := keys.ListKeys(ctx, connect.NewRequest(&adminv1.ListKeysRequest{OrgId: st.OrgID, TeamId: st.TeamID, AliasPrefix: k.alias}))
		if err != nil {
			return st, err
		}
		var existing *adminv1.Key
		for _, have := range kl.Msg.Keys {
			if have.Alias == k.alias {
				existing = have
			}
		}
		if existing != nil && (len(existing.ModelGroupAliases) > 0 || !proto.Equal(existing.Limits, k.limits)) {
			// An earlier demo routed the agent key to a pool of its own.
			if _, err := keys.UpdateKey(ctx, connect.NewRequest(&adminv1.UpdateKeyRequest{
				Key:        &adminv1.Key{Id: existing.Id, ModelGroupAliases: k.aliases, Limits: k.limits},
				UpdateMask: &fieldmaskpb.FieldMask{Paths: []string{"model_group_aliases", "limits"}},
			})); err != nil {
				return st, err
			}
		}
		if existing != nil {
			if s, ok := saved[k.alias]; ok && s.ID == existing.Id && s.Rotations == existing.RotationCount &&
				strings.HasSuffix(s.Token, existing.Last4) {
				st.Keys[k.alias], st.demoKeys[k.alias] = s.Token, s
				continue
			}
			r, err := keys.RotateKey(ctx, connect.NewRequest(&adminv1.RotateKeyRequest{Id: existing.Id}))
			if err != nil {
				return st, err
			}
			st.Keys[k.alias], st.keysChanged = r.Msg.Token, true
			st.demoKeys[k.alias] = demoKey{ID: existing.Id, Token: r.Msg.Token, Rotations: r.Msg.Key.RotationCount}
			continue
		}
		r, err := keys.CreateKey(ctx, connect.NewRequest(&adminv1.CreateKeyRequest{
			OrgId: st.OrgID, TeamId: st.TeamID, UserId: userIDs[k.user], Alias: k.alias, TrafficClass: k.class, Limits: k.limits,
			ModelGroupAliases: k.aliases,
		}))
		if err != nil {
			return st, err
		}
		st.Keys[k.alias], st.keysChanged = r.Msg.Token, true
		st.demoKeys[k.alias] = demoKey{ID: r.Msg.Key.Id, Token: r.Msg.Token, Rotations: r.Msg.Key.RotationCount}
	}
	return st, nil
}

// devModel is the model name the demo serves.
const devModel = "qwen-30b"

// devProtocols are the agent protocols vllm-sim serves besides the OpenAI
// routes, declared on the demo deployments (docs/protocols.md).
var devProtocols = []string{"anthropic_messages", "openai_responses"}

// devCapabilities are the demo deployments' capabilities.
func devCapabilities() *adminv1.Capabilities {
	return &adminv1.Capabilities{Tools: true, JsonMode: true, MaxInputTokens: 32768, MaxOutputTokens: 4096, Protocols: slices.Clone(devProtocols)}
}

// The demo pool: two engines of max_num_seqs devEngineSeqs behind one
// model group, devReserve slots of each kept for interactive requests.
const (
	devEngineSeqs       = 8
	devReserve          = 2
	devPrefillIsolation = 1
)

// devEngines are the demo engines' names, in deployment order.
var devEngines = []string{"engine-1", "engine-2"}

// seedModels creates the demo model group, one deployment per simulated
// engine (updating api_base when the engine moved, which it reports, and
// max_concurrency when an earlier demo set another), and the pool's
// traffic settings: an interactive reserve, engine priority and prefill
// isolation.
func seedModels(ctx context.Context, models adminv1connect.ModelServiceClient, traffic adminv1connect.TrafficServiceClient, engines map[string]string) (moved bool, err error) {
	group := devModel
	if _, err := models.GetModelGroup(ctx, connect.NewRequest(&adminv1.GetModelGroupRequest{Name: group})); connect.CodeOf(err) == connect.CodeNotFound {
		if _, err := models.CreateModelGroup(ctx, connect.NewRequest(&adminv1.CreateModelGroupRequest{
			Name: group, Description: "demo pool of two vllm-sim engines shared by people and agents", PlatformWide: true})); err != nil {
			return moved, err
		}
	} else if err != nil {
		return moved, err
	}
	dl, err := models.ListDeployments(ctx, connect.NewRequest(&adminv1.ListDeploymentsRequest{ModelGroup: group}))
	if err != nil {
		return moved, err
	}
	want := &adminv1.DeploymentTraffic{InteractiveReserve: devReserve, PriorityScheduling: true}
	for i, name := range devEngines {
		apiBase := engines[name] + "/v1"
		var id string
		if i < len(dl.Msg.Deployments) {
			d := dl.Msg.Deployments[i]
			id = d.Id
			var paths []string
			if d.ApiBase != apiBase {
				paths, moved = append(paths, "api_base"), true
			}
			if d.MaxConcurrency != devEngineSeqs {
				paths = append(paths, "max_concurrency")
			}
			caps := d.Capabilities
			if !slices.Equal(caps.GetProtocols(), devProtocols) {
				// A demo seeded before the engines' protocols were declared.
				caps = proto.Clone(devCapabilities()).(*adminv1.Capabilities)
				paths = append(paths, "capabilities")
			}
			if len(paths) > 0 {
				if _, err := models.UpdateDeployment(ctx, connect.NewRequest(&adminv1.UpdateDeploymentRequest{
					Deployment: &adminv1.Deployment{Id: d.Id, ApiBase: apiBase, MaxConcurrency: devEngineSeqs, Capabilities: caps},
					UpdateMask: &fieldmaskpb.FieldMask{Paths: paths},
				})); err != nil {
					return moved, err
				}
			}
		} else {
			r, err := models.CreateDeployment(ctx, connect.NewRequest(&adminv1.CreateDeploymentRequest{
				ModelGroup: group, ApiBase: apiBase, UpstreamModel: vllmsim.DefaultModel, Weight: 1, MaxConcurrency: devEngineSeqs,
				Capabilities: devCapabilities(),
				Prices:       &adminv1.Prices{InputPerToken: 0.0000002, OutputPerToken: 0.0000006},
			}))
			if err != nil {
				return moved, err
			}
			id = r.Msg.Deployment.Id
		}
		cur, err := traffic.GetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.GetDeploymentTrafficRequest{DeploymentId: id}))
		if err != nil {
			return moved, err
		}
		if !proto.Equal(cur.Msg.Traffic, want) {
			if _, err := traffic.SetDeploymentTraffic(ctx, connect.NewRequest(&adminv1.SetDeploymentTrafficRequest{DeploymentId: id, Traffic: want})); err != nil {
				return moved, err
			}
		}
	}
	// One of the two engines is kept free of agent prefill at every moment
	// (docs/traffic.md, "Prefill isolation"): a chat never shares an engine
	// step with an agent's prompt. Set once; an operator's later change of
	// the group's traffic settings is kept.
	cur, err := traffic.GetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.GetModelGroupTrafficRequest{ModelGroup: group}))
	if err != nil {
		return moved, err
	}
	if cur.Msg.GetTraffic() == nil || proto.Equal(cur.Msg.GetTraffic(), &adminv1.ModelGroupTraffic{}) {
		if _, err := traffic.SetModelGroupTraffic(ctx, connect.NewRequest(&adminv1.SetModelGroupTrafficRequest{ModelGroup: group,
			Traffic: &adminv1.ModelGroupTraffic{PrefillIsolation: devPrefillIsolation}})); err != nil {
			return moved, err
		}
	}
	return moved, nil
}

// startDevNATS runs an embedded NATS server with JetStream on loopback.
func startDevNATS(dir string, port int) (*server.Server, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir,
		NoLog: true, NoSigs: true, SyncAlways: true})
	if err != nil {
		return nil, fmt.Errorf("embedded nats: %w", err)
	}
	go ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		ns.Shutdown()
		return nil, fmt.Errorf("embedded nats did not start on port %d (in use? pass --nats-port)", port)
	}
	return ns, nil
}

// startDevEngines runs the demo pool's two simulated vLLM engines
// (max_num_seqs devEngineSeqs, priority scheduling).
func startDevEngines(log *slog.Logger) (map[string]*vllmsim.Server, error) {
	out := map[string]*vllmsim.Server{}
	for _, name := range devEngines {
		cfg := vllmsim.DefaultConfig()
		cfg.Addr = "127.0.0.1:0"
		cfg.MaxNumSeqs, cfg.SchedulingPolicy = devEngineSeqs, vllmsim.PolicyPriority
		s, err := vllmsim.Start(cfg, log.With("engine", name))
		if err != nil {
			for _, e := range out {
				_ = e.Close()
			}
			return nil, fmt.Errorf("start %s engine: %w", name, err)
		}
		out[name] = s
	}
	return out, nil
}
