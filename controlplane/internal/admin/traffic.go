package admin

import (
	"context"
	"fmt"
	"regexp"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// trafficService implements TrafficService (SPEC §1, §7.2): an org's class
// settings (org editors and admins), and deployments' and model groups'
// class-aware admission settings (platform editors and admins, like the
// objects themselves). Each Set replaces the whole settings message; the
// change, its audit record and the owner's upsert event commit together,
// so the settings reach data planes inside the owner's snapshot entry.
type trafficService struct{ *Server }

// Audit object types of traffic settings; the object id is the owner's.
const (
	objOrgTraffic        = "org_traffic"
	objDeploymentTraffic = "deployment_traffic"
	objModelGroupTraffic = "model_group_traffic"
)

// Traffic bounds. A queue longer than maxQueueLength or a wait longer
// than maxQueueTimeoutMs would hold client connections for no purpose.
const (
	maxRules          = 64
	maxHeaderNameLen  = 128
	maxPatternLen     = 1024
	maxQueueLength    = 100_000
	maxQueueTimeoutMs = 600_000
	maxEnginePriority = 1_000_000
)

// headerNamePattern is an RFC 9110 field name (token).
var headerNamePattern = regexp.MustCompile("^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")

// credentialHeaders carry secrets: a rule on them would keep a pattern
// over credentials in the config and its audit log, so they are refused.
var credentialHeaders = map[string]bool{
	"authorization": true, "proxy-authorization": true, "cookie": true,
	"x-api-key": true, "api-key": true,
}

func validClass(c adminv1.TrafficClass) bool {
	switch c {
	case adminv1.TrafficClass_TRAFFIC_CLASS_INTERACTIVE, adminv1.TrafficClass_TRAFFIC_CLASS_AGENT,
		adminv1.TrafficClass_TRAFFIC_CLASS_BATCH:
		return true
	}
	return false
}

// validateOrgTraffic checks an org's class settings, naming every bad
// field.
func validateOrgTraffic(c *validator, t *adminv1.OrgTraffic) {
	if dc := t.GetDefaultClass(); dc != adminv1.TrafficClass_TRAFFIC_CLASS_UNSPECIFIED && !validClass(dc) {
		c.add("traffic.default_class", "unknown traffic class %d: must be interactive, agent or batch (or unset: interactive)", dc)
	}
	if len(t.GetRules()) > maxRules {
		c.add("traffic.rules", "at most %d rules (got %d)", maxRules, len(t.GetRules()))
	}
	for i, r := range t.GetRules() {
		f := fmt.Sprintf("traffic.rules[%d]", i)
		h := r.GetHeader()
		switch {
		case h == "":
			c.add(f+".header", "required: the header whose value the pattern matches, e.g. User-Agent")
		case len(h) > maxHeaderNameLen || !headerNamePattern.MatchString(h):
			c.add(f+".header", "must be a header name of at most %d token characters", maxHeaderNameLen)
		case credentialHeaders[strings.ToLower(h)]:
			c.add(f+".header", "%s carries credentials: classification rules cannot read it", h)
		}
		switch p := r.GetPattern(); {
		case p == "":
			c.add(f+".pattern", "required: an RE2 regular expression, e.g. ^claude-code/")
		case len(p) > maxPatternLen:
			c.add(f+".pattern", "must be at most %d bytes", maxPatternLen)
		default:
			if _, err := regexp.Compile(p); err != nil {
				c.add(f+".pattern", "is not an RE2 regular expression: %v", err)
			}
		}
		if !validClass(r.GetTrafficClass()) {
			c.add(f+".traffic_class", "must be interactive, agent or batch (got %d)", r.GetTrafficClass())
		}
	}
	d := t.GetDemotion()
	validTokens(c, "traffic.demotion.max_prompt_tokens", d.GetMaxPromptTokens())
	if n := d.GetMaxInteractiveInFlightPerKey(); n < 0 || n > maxConcurrency {
		c.add("traffic.demotion.max_interactive_in_flight_per_key", "must be 0 (off) to %d (got %d)", maxConcurrency, n)
	}
}

func validateQueues(c *validator, qs []*adminv1.ClassQueue) {
	seen := map[adminv1.TrafficClass]bool{}
	for i, q := range qs {
		f := fmt.Sprintf("traffic.queues[%d]", i)
		switch cl := q.GetTrafficClass(); {
		case !validClass(cl):
			c.add(f+".traffic_class", "must be interactive, agent or batch (got %d)", cl)
		case seen[cl]:
			c.add(f+".traffic_class", "duplicate class %s", cl)
		}
		seen[q.GetTrafficClass()] = true
		if n := q.GetMaxLength(); n < 0 || n > maxQueueLength {
			c.add(f+".max_length", "must be 0 (the proxy's default) to %d (got %d)", maxQueueLength, n)
		}
		if n := q.GetTimeoutMs(); n < 0 || n > maxQueueTimeoutMs {
			c.add(f+".timeout_ms", "must be 0 (the proxy's default) to %d (got %d)", maxQueueTimeoutMs, n)
		}
		if q.GetMaxLength() == 0 && q.GetTimeoutMs() == 0 {
			c.add(f, "overrides nothing: set max_length and/or timeout_ms, or remove the entry")
		}
	}
}

// validateDeploymentTraffic checks a deployment's class settings against
// its max_concurrency (the engine's max_num_seqs).
func validateDeploymentTraffic(c *validator, t *adminv1.DeploymentTraffic, maxConc int64) {
	r := t.GetInteractiveReserve()
	switch {
	case r < 0:
		c.add("traffic.interactive_reserve", "must not be negative (got %d)", r)
	case r > 0 && maxConc == 0:
		c.add("traffic.interactive_reserve", "needs the deployment's max_concurrency (its engine's max_num_seqs): a reserve is a share of it")
	case r > maxConc:
		c.add("traffic.interactive_reserve", "must be at most the deployment's max_concurrency %d (got %d)", maxConc, r)
	}
	b := t.GetBatchMaxConcurrency()
	switch {
	case b < 0 || b > maxConcurrency:
		c.add("traffic.batch_max_concurrency", "must be 0 (no batch cap) to %d (got %d)", maxConcurrency, b)
	case maxConc > 0 && r >= 0 && r <= maxConc && b > maxConc-r:
		c.add("traffic.batch_max_concurrency", "must be at most max_concurrency − interactive_reserve = %d (got %d)", maxConc-r, b)
	}
	validTokens(c, "traffic.max_prefill_tokens_in_flight", t.GetMaxPrefillTokensInFlight())
	if t.GetMaxPrefillTokensInFlight() > 0 && maxConc == 0 {
		// The data plane counts prefill in flight in the deployment's
		// fleet-wide max_concurrency lease (docs/traffic.md): without
		// max_concurrency the cap would be a dead setting.
		c.add("traffic.max_prefill_tokens_in_flight", "needs the deployment's max_concurrency: prefill in flight is counted with its fleet-wide concurrency lease")
	}
	if cp := t.GetClassPriority(); cp != nil {
		if !t.GetPriorityScheduling() {
			c.add("traffic.class_priority", "only with priority_scheduling: a deployment without it is sent no priority (vLLM rejects one it cannot schedule)")
		}
		for name, v := range map[string]*int32{"interactive": cp.Interactive, "agent": cp.Agent, "batch": cp.Batch} {
			if v != nil && (*v < -maxEnginePriority || *v > maxEnginePriority) {
				c.add("traffic.class_priority."+name, "must be within ±%d (got %d)", maxEnginePriority, *v)
			}
		}
	}
	validateQueues(c, t.GetQueues())
}

func trafficJSON(m proto.Message) []byte {
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		panic(err) // a generated message always marshals
	}
	if len(b) == 0 {
		return []byte("{}")
	}
	return b
}

func trafficFromJSON(b []byte, m proto.Message) error {
	if len(b) == 0 {
		return nil
	}
	if err := protojson.Unmarshal(b, m); err != nil {
		return fmt.Errorf("decode traffic settings: %w", err)
	}
	return nil
}

// checkDeploymentTraffic is UpdateDeployment's check that a new
// max_concurrency still holds the deployment's stored reserve and caps.
func checkDeploymentTraffic(c *validator, stored []byte, maxConc int64) error {
	t := &adminv1.DeploymentTraffic{}
	if err := trafficFromJSON(stored, t); err != nil {
		return err
	}
	sub := &validator{}
	validateDeploymentTraffic(sub, t, maxConc)
	for _, v := range sub.v {
		c.add("max_concurrency", "%d conflicts with the deployment's traffic settings (%s: %s); change them first (TrafficService.SetDeploymentTraffic)", maxConc, v.Field, v.Desc)
	}
	return nil
}

func (s *trafficService) GetOrgTraffic(ctx context.Context, req *connect.Request[adminv1.GetOrgTrafficRequest]) (*connect.Response[adminv1.GetOrgTrafficResponse], error) {
	o, err := s.store.OrgGet(ctx, tenant(ctx), req.Msg.GetOrgId())
	if err != nil {
		return nil, err
	}
	if err := authz.Check(ctx, principal(ctx), authz.Read, authz.OrgTarget(o.ID, "org "+o.ID)); err != nil {
		return nil, err
	}
	t := &adminv1.OrgTraffic{}
	if err := trafficFromJSON(o.Traffic, t); err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetOrgTrafficResponse{Traffic: t}), nil
}

func (s *trafficService) SetOrgTraffic(ctx context.Context, req *connect.Request[adminv1.SetOrgTrafficRequest]) (*connect.Response[adminv1.SetOrgTrafficResponse], error) {
	after := req.Msg.GetTraffic()
	if after == nil {
		after = &adminv1.OrgTraffic{}
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.OrgGetForUpdate(ctx, tenant(ctx), req.Msg.GetOrgId())
		if err != nil {
			return err
		}
		if err := authz.Check(ctx, principal(ctx), authz.Write, authz.OrgTarget(cur.ID, "org "+cur.ID)); err != nil {
			return err
		}
		c := &validator{}
		validateOrgTraffic(c, after)
		if err := c.err(); err != nil {
			return err
		}
		before := &adminv1.OrgTraffic{}
		if err := trafficFromJSON(cur.Traffic, before); err != nil {
			return err
		}
		if err := tx.OrgTrafficSet(ctx, &cur, trafficJSON(after)); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionUpdated, objOrgTraffic, cur.ID, cur.ID, "", auditJSON(before), auditJSON(after)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.OrgUpserted, cur.ID, cur.ID, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.SetOrgTrafficResponse{Traffic: after}), nil
}

func (s *trafficService) GetDeploymentTraffic(ctx context.Context, req *connect.Request[adminv1.GetDeploymentTrafficRequest]) (*connect.Response[adminv1.GetDeploymentTrafficResponse], error) {
	if err := readShared(ctx, "deployments"); err != nil {
		return nil, err
	}
	d, err := s.store.DeploymentGet(ctx, req.Msg.GetDeploymentId())
	if err != nil {
		return nil, err
	}
	if err := s.deploymentVisible(ctx, d); err != nil {
		return nil, err
	}
	t := &adminv1.DeploymentTraffic{}
	if err := trafficFromJSON(d.Traffic, t); err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetDeploymentTrafficResponse{Traffic: t}), nil
}

func (s *trafficService) SetDeploymentTraffic(ctx context.Context, req *connect.Request[adminv1.SetDeploymentTrafficRequest]) (*connect.Response[adminv1.SetDeploymentTrafficResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	after := req.Msg.GetTraffic()
	if after == nil {
		after = &adminv1.DeploymentTraffic{}
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.DeploymentGetForUpdate(ctx, req.Msg.GetDeploymentId())
		if err != nil {
			return err
		}
		c := &validator{}
		validateDeploymentTraffic(c, after, cur.MaxConcurrency)
		if err := c.err(); err != nil {
			return err
		}
		before := &adminv1.DeploymentTraffic{}
		if err := trafficFromJSON(cur.Traffic, before); err != nil {
			return err
		}
		if err := tx.DeploymentTrafficSet(ctx, &cur, trafficJSON(after)); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionUpdated, objDeploymentTraffic, cur.ID, "", "", auditJSON(before), auditJSON(after)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.DeploymentUpserted, "", cur.ID, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.SetDeploymentTrafficResponse{Traffic: after}), nil
}

func (s *trafficService) GetModelGroupTraffic(ctx context.Context, req *connect.Request[adminv1.GetModelGroupTrafficRequest]) (*connect.Response[adminv1.GetModelGroupTrafficResponse], error) {
	if err := readShared(ctx, "model groups"); err != nil {
		return nil, err
	}
	g, err := s.store.ModelGroupGet(ctx, req.Msg.GetModelGroup())
	if err != nil {
		return nil, err
	}
	if err := modelGroupVisible(ctx, g); err != nil {
		return nil, err
	}
	t := &adminv1.ModelGroupTraffic{}
	if err := trafficFromJSON(g.Traffic, t); err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetModelGroupTrafficResponse{Traffic: t}), nil
}

func (s *trafficService) SetModelGroupTraffic(ctx context.Context, req *connect.Request[adminv1.SetModelGroupTrafficRequest]) (*connect.Response[adminv1.SetModelGroupTrafficResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	after := req.Msg.GetTraffic()
	if after == nil {
		after = &adminv1.ModelGroupTraffic{}
	}
	c := &validator{}
	validateQueues(c, after.GetQueues())
	if err := s.validatePrefillIsolation(ctx, c, req.Msg.GetModelGroup(), after.GetPrefillIsolation()); err != nil {
		return nil, err
	}
	if err := c.err(); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.ModelGroupGetForUpdate(ctx, req.Msg.GetModelGroup())
		if err != nil {
			return err
		}
		before := &adminv1.ModelGroupTraffic{}
		if err := trafficFromJSON(cur.Traffic, before); err != nil {
			return err
		}
		if err := tx.ModelGroupTrafficSet(ctx, &cur, trafficJSON(after)); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionUpdated, objModelGroupTraffic, cur.Name, "", "", auditJSON(before), auditJSON(after)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.ModelGroupUpserted, "", cur.Name, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.SetModelGroupTrafficResponse{Traffic: after}), nil
}

// validatePrefillIsolation checks a group's prefill_isolation K: 0 (off)
// or positive and below the group's number of deployments N, so that at
// least one deployment can take agent prefill. A data plane that later
// sees K ≥ N (deployments deleted since) lets agent prefill run on one
// deployment at a time (docs/traffic.md, "Prefill isolation").
func (s *trafficService) validatePrefillIsolation(ctx context.Context, c *validator, group string, k int64) error {
	const field = "traffic.prefill_isolation"
	switch {
	case k == 0:
		return nil
	case k < 0:
		c.add(field, "must be 0 (off) or a number of deployments")
		return nil
	}
	deps, err := s.store.DeploymentList(ctx, store.DeploymentQuery{ModelGroup: group}, store.Page{Limit: int(min(k, 1000)) + 1})
	if err != nil {
		return err
	}
	if int64(len(deps)) <= k {
		c.add(field, "must be below the group's number of deployments (%d): at least one deployment must be able to take agent and batch prefill", len(deps))
	}
	return nil
}
