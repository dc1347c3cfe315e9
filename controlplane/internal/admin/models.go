package admin

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/fieldmaskpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/sluicegw/sluice/controlplane/internal/audit"
	"github.com/sluicegw/sluice/controlplane/internal/authz"
	"github.com/sluicegw/sluice/controlplane/internal/events"
	"github.com/sluicegw/sluice/controlplane/internal/store"
	"github.com/sluicegw/sluice/internal/ids"
	adminv1 "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1"
)

// modelService implements ModelService. Model groups and deployments are
// platform infrastructure: platform-scoped editors and admins change them;
// every admin token may read them (they carry no tenant data, and a
// deployment's credential is never returned, only has_credential).
type modelService struct{ *Server }

const (
	objModelGroup = string(events.ObjModelGroup)
	objDeployment = string(events.ObjDeployment)
	// deploymentIDPrefix is the id prefix of deployments ("dep_...").
	deploymentIDPrefix = "dep"
)

// Deployment bounds. Prices are USD per token: a price above maxPrice is
// almost certainly a per-million price typed into a per-token field.
const (
	maxDescriptionLen = 1000
	maxAPIBaseLen     = 2000
	maxWeight         = 1000
	maxConcurrency    = 1_000_000
	maxTokensBound    = 1_000_000_000
	maxTags           = 32
	maxCredentialLen  = 4096
	maxPrice          = 1.0
)

// modelGroupNamePattern matches the model_groups.name check constraint.
// Deployment tags share keys' tagPattern.
var modelGroupNamePattern = regexp.MustCompile(`^[A-Za-z0-9._:/-]{1,100}$`)

// deploymentMaskPaths are the fields UpdateDeployment may change (besides
// "credential", which is not a Deployment field).
var deploymentMaskPaths = []string{"api_base", "upstream_model", "weight", "max_concurrency", "capabilities", "tags", "prices", "free"}

// readShared authorises reading a platform object every principal may
// see: the check runs against the principal's own scope, so it only
// requires the viewer role.
func readShared(ctx context.Context, what string) error {
	p := principal(ctx)
	t := authz.PlatformTarget(what)
	if p != nil {
		switch p.Scope {
		case authz.ScopeOrg:
			t = authz.OrgTarget(p.OrgID, what)
		case authz.ScopeTeam:
			t = authz.TeamTarget(p.OrgID, p.TeamID, what)
		}
	}
	return authz.Check(ctx, p, authz.Read, t)
}

func writeModels(ctx context.Context) error {
	return authz.Check(ctx, principal(ctx), authz.Write, authz.PlatformTarget("changing model groups and deployments"))
}

func modelGroupToProto(g store.ModelGroup) (*adminv1.ModelGroup, error) {
	r, err := routingFromJSON(g.Routing)
	if err != nil {
		return nil, fmt.Errorf("model group %s: %w", g.Name, err)
	}
	res, err := resilienceFromJSON(g.Resilience)
	if err != nil {
		return nil, fmt.Errorf("model group %s: %w", g.Name, err)
	}
	return &adminv1.ModelGroup{Name: g.Name, Description: g.Description, PlatformWide: g.PlatformWide, Routing: r,
		Fallbacks: slices.Clone(g.Fallbacks), Resilience: res,
		GrantedOrgIds: slices.Clone(g.OrgIDs), CreateTime: timestamppb.New(g.CreatedAt), UpdateTime: timestamppb.New(g.UpdatedAt)}, nil
}

// modelGroupFor is g as ctx's principal may see it: the grants of other
// orgs are shown to platform tokens only.
func modelGroupFor(ctx context.Context, g store.ModelGroup) (*adminv1.ModelGroup, error) {
	m, err := modelGroupToProto(g)
	if err != nil {
		return nil, err
	}
	if p := principal(ctx); p == nil || p.Scope != authz.ScopePlatform {
		m.GrantedOrgIds = nil
	}
	return m, nil
}

// visibleOrg is the org whose grants confine ctx's principal's reads of
// model groups and deployments ("" for platform tokens: every group).
func visibleOrg(ctx context.Context) string {
	if p := principal(ctx); p != nil && p.Scope != authz.ScopePlatform {
		return p.OrgID
	}
	return ""
}

// deploymentVisible answers NotFound, as if d did not exist, when ctx's
// principal's org may not see d's model group.
func (s *Server) deploymentVisible(ctx context.Context, d store.Deployment) error {
	org := visibleOrg(ctx)
	if org == "" {
		return nil
	}
	g, err := s.store.ModelGroupGet(ctx, d.ModelGroup)
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return err
	}
	if err != nil || !groupVisible(org, g) {
		return connect.NewError(connect.CodeNotFound, errors.New("deployment "+d.ID+" not found"))
	}
	return nil
}

// modelGroupVisible answers NotFound, as if g did not exist, when ctx's
// principal's org may not see it.
func modelGroupVisible(ctx context.Context, g store.ModelGroup) error {
	if !groupVisible(visibleOrg(ctx), g) {
		return connect.NewError(connect.CodeNotFound, errors.New("model group "+g.Name+" not found"))
	}
	return nil
}

// groupVisible reports whether org (visibleOrg's answer) may see g.
func groupVisible(org string, g store.ModelGroup) bool {
	return org == "" || g.PlatformWide || slices.Contains(g.OrgIDs, org)
}

func deploymentToProto(d store.Deployment) *adminv1.Deployment {
	c := d.Capabilities
	return &adminv1.Deployment{
		Id: d.ID, ModelGroup: d.ModelGroup, ApiBase: d.APIBase, UpstreamModel: d.UpstreamModel,
		HasCredential: len(d.CredentialCiphertext) > 0, Weight: d.Weight, MaxConcurrency: d.MaxConcurrency,
		Capabilities: &adminv1.Capabilities{Tools: c.Tools, JsonMode: c.JSONMode, Vision: c.Vision,
			MaxInputTokens: c.MaxInputTokens, MaxOutputTokens: c.MaxOutputTokens, Protocols: slices.Clone(c.Protocols)},
		Tags: slices.Clone(d.Tags),
		Prices: &adminv1.Prices{InputPerToken: d.InputPrice, OutputPerToken: d.OutputPrice,
			CachedInputPerToken: d.CachedInputPrice},
		Free: d.Free, CreateTime: timestamppb.New(d.CreatedAt), UpdateTime: timestamppb.New(d.UpdatedAt),
	}
}

// setDeploymentFields copies the settable fields of a validated API object
// into the stored deployment (the credential is handled separately).
func setDeploymentFields(d *store.Deployment, m *adminv1.Deployment) {
	c := m.GetCapabilities()
	d.APIBase, d.UpstreamModel, d.Weight, d.MaxConcurrency = m.GetApiBase(), m.GetUpstreamModel(), m.GetWeight(), m.GetMaxConcurrency()
	d.Capabilities = store.Capabilities{Tools: c.GetTools(), JSONMode: c.GetJsonMode(), Vision: c.GetVision(),
		MaxInputTokens: c.GetMaxInputTokens(), MaxOutputTokens: c.GetMaxOutputTokens(), Protocols: slices.Clone(c.GetProtocols())}
	d.Tags = slices.Clone(m.GetTags())
	p := m.GetPrices()
	d.InputPrice, d.OutputPrice, d.CachedInputPrice = p.GetInputPerToken(), p.GetOutputPerToken(), p.GetCachedInputPerToken()
	d.Free = m.GetFree()
}

func validModelGroupName(c *validator, field, name string) {
	if !modelGroupNamePattern.MatchString(name) {
		c.add(field, "model group name %q must be 1–100 characters of [A-Za-z0-9._:/-]", name)
	}
}

func validateDescription(c *validator, s string) {
	if !utf8.ValidString(s) || utf8.RuneCountInString(s) > maxDescriptionLen {
		c.add("description", "must be at most %d characters of valid UTF-8", maxDescriptionLen)
	}
}

// validateAPIBase checks an upstream base URL: http or https, a host, and
// no credentials, query or fragment (credentials belong in `credential`,
// which is encrypted at rest; a URL is stored and shown in clear).
func validateAPIBase(c *validator, s string) {
	if s == "" {
		c.add("api_base", "required: the upstream's OpenAI-compatible base URL, e.g. http://vllm-a:8000/v1")
		return
	}
	if len(s) > maxAPIBaseLen {
		c.add("api_base", "must be at most %d bytes", maxAPIBaseLen)
		return
	}
	u, err := url.Parse(s)
	switch {
	case err != nil:
		c.add("api_base", "is not a URL")
	case u.Scheme != "http" && u.Scheme != "https":
		c.add("api_base", "must be an http:// or https:// URL (got scheme %q)", u.Scheme)
	case u.Host == "" || u.Hostname() == "":
		c.add("api_base", "must name a host")
	case u.User != nil:
		c.add("api_base", "must not contain credentials; give the upstream credential in `credential` (it is encrypted at rest)")
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		c.add("api_base", "must not have a query or fragment")
	}
}

func validPrice(c *validator, field string, v float64) {
	switch {
	case math.IsNaN(v) || math.IsInf(v, 0):
		c.add(field, "must be a finite number")
	case v < 0:
		c.add(field, "must not be negative (got %g)", v)
	case v > maxPrice:
		c.add(field, "must be at most %g USD per token (got %g); prices are per token, e.g. 0.000002 for $2 per million tokens", float64(maxPrice), v)
	}
}

func validTokens(c *validator, field string, v int64) {
	switch {
	case v < 0:
		c.add(field, "must not be negative (got %d); 0 means no limit", v)
	case v > maxTokensBound:
		c.add(field, "must be at most %d (got %d)", maxTokensBound, v)
	}
}

// validateDeployment checks the settable fields of d (weight already
// defaulted). Prices are required unless the deployment is declared free,
// and a free deployment has no prices.
func validateDeployment(c *validator, d *adminv1.Deployment) {
	validateAPIBase(c, d.GetApiBase())
	validModelName(c, "upstream_model", d.GetUpstreamModel())
	if w := d.GetWeight(); w < 1 || w > maxWeight {
		c.add("weight", "must be 1–%d (got %d); 0 means 1", maxWeight, w)
	}
	if m := d.GetMaxConcurrency(); m < 0 || m > maxConcurrency {
		c.add("max_concurrency", "must be 0 (no cap) to %d (got %d)", maxConcurrency, m)
	}
	validTokens(c, "capabilities.max_input_tokens", d.GetCapabilities().GetMaxInputTokens())
	validTokens(c, "capabilities.max_output_tokens", d.GetCapabilities().GetMaxOutputTokens())
	validateProtocols(c, d.GetCapabilities().GetProtocols())
	if len(d.GetTags()) > maxTags {
		c.add("tags", "at most %d tags (got %d)", maxTags, len(d.GetTags()))
	}
	seen := map[string]bool{}
	for i, t := range d.GetTags() {
		f := fmt.Sprintf("tags[%d]", i)
		if !tagPattern.MatchString(t) {
			c.add(f, "tag %q must be 1–64 characters of [A-Za-z0-9_.:/-]", t)
		}
		if seen[t] {
			c.add(f, "duplicate tag %q", t)
		}
		seen[t] = true
	}
	p := d.GetPrices()
	validPrice(c, "prices.input_per_token", p.GetInputPerToken())
	validPrice(c, "prices.output_per_token", p.GetOutputPerToken())
	validPrice(c, "prices.cached_input_per_token", p.GetCachedInputPerToken())
	priced := p.GetInputPerToken() > 0 || p.GetOutputPerToken() > 0
	anyPrice := priced || p.GetCachedInputPerToken() > 0
	switch {
	case d.GetFree() && anyPrice:
		c.add("prices", "must be zero or unset on a free deployment; clear `free` to charge for it")
	case !d.GetFree() && !priced:
		c.add("prices", "required: set input_per_token and/or output_per_token (USD per token), or declare the deployment free (`free`)")
	}
}

// validateCredential bounds an upstream credential. It never echoes the
// value.
func validateCredential(c *validator, cred string) {
	if len(cred) > maxCredentialLen {
		c.add("credential", "must be at most %d bytes (got %d)", maxCredentialLen, len(cred))
		return
	}
	if strings.TrimSpace(cred) != cred {
		c.add("credential", "must not have surrounding spaces")
	}
	if strings.ContainsFunc(cred, unicode.IsControl) || !utf8.ValidString(cred) {
		c.add("credential", "must be valid UTF-8 without control characters")
	}
}

// errNoKeyRing is returned when a credential must be sealed but the
// server has no key ring (the control plane always configures one).
var errNoKeyRing = connect.NewError(connect.CodeFailedPrecondition,
	errors.New("no key ring is configured (SLUICE_KEK); upstream credentials cannot be stored"))

// seal encrypts a credential for storage ("" gives nil: no credential).
func (s *modelService) seal(cred string) ([]byte, error) {
	if cred == "" {
		return nil, nil
	}
	if s.keys == nil {
		return nil, errNoKeyRing
	}
	return s.keys.Seal([]byte(cred)), nil
}

func (s *modelService) CreateModelGroup(ctx context.Context, req *connect.Request[adminv1.CreateModelGroupRequest]) (*connect.Response[adminv1.CreateModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	m := req.Msg
	c := &validator{}
	validModelGroupName(c, "name", m.GetName())
	validateDescription(c, m.GetDescription())
	validateRouting(c, routingMaskTop, m.GetRouting())
	validateFallbackList(c, "fallbacks", m.GetName(), m.GetFallbacks())
	validateResilience(c, "resilience", m.GetResilience())
	if err := c.err(); err != nil {
		return nil, err
	}
	g := store.ModelGroup{Name: m.GetName(), Description: m.GetDescription(), PlatformWide: m.GetPlatformWide(),
		Routing: routingJSON(m.GetRouting())}
	var out *adminv1.ModelGroup
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if err := tx.ModelGroupInsert(ctx, &g); err != nil {
			return err
		}
		if len(m.GetFallbacks()) > 0 {
			if err := checkFallbackGraph(ctx, tx, func(string) string { return "fallbacks" }, map[string][]string{g.Name: m.GetFallbacks()}); err != nil {
				return err
			}
		}
		if err := tx.ModelGroupResilienceSet(ctx, &g, m.GetFallbacks(), resilienceJSON(m.GetResilience())); err != nil {
			return err
		}
		var err error
		if out, err = modelGroupToProto(g); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionCreated, objModelGroup, g.Name, "", "", nil, auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.ModelGroupUpserted, "", g.Name, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateModelGroupResponse{ModelGroup: out}), nil
}

func (s *modelService) GetModelGroup(ctx context.Context, req *connect.Request[adminv1.GetModelGroupRequest]) (*connect.Response[adminv1.GetModelGroupResponse], error) {
	if err := readShared(ctx, "model groups"); err != nil {
		return nil, err
	}
	g, err := s.store.ModelGroupGet(ctx, req.Msg.GetName())
	if err != nil {
		return nil, err
	}
	// As if it did not exist: an org learns nothing of groups it was
	// not granted.
	if err := modelGroupVisible(ctx, g); err != nil {
		return nil, err
	}
	out, err := modelGroupFor(ctx, g)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetModelGroupResponse{ModelGroup: out}), nil
}

func (s *modelService) ListModelGroups(ctx context.Context, req *connect.Request[adminv1.ListModelGroupsRequest]) (*connect.Response[adminv1.ListModelGroupsResponse], error) {
	if err := readShared(ctx, "model groups"); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	var rows []store.ModelGroup
	if org := visibleOrg(ctx); org != "" {
		rows, err = s.store.ModelGroupVisibleList(ctx, org, store.Page{After: after, Limit: limit})
	} else {
		rows, err = s.store.ModelGroupList(ctx, store.Page{After: after, Limit: limit})
	}
	if err != nil {
		return nil, err
	}
	resp := &adminv1.ListModelGroupsResponse{}
	for _, g := range rows {
		m, err := modelGroupFor(ctx, g)
		if err != nil {
			return nil, err
		}
		resp.ModelGroups = append(resp.ModelGroups, m)
	}
	if len(rows) > 0 {
		resp.NextPageToken = nextPageToken(len(rows), limit, rows[len(rows)-1].Name)
	}
	return connect.NewResponse(resp), nil
}

func (s *modelService) UpdateModelGroup(ctx context.Context, req *connect.Request[adminv1.UpdateModelGroupRequest]) (*connect.Response[adminv1.UpdateModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	name := req.Msg.GetModelGroup().GetName()
	var out *adminv1.ModelGroup
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.ModelGroupGetForUpdate(ctx, name)
		if err != nil {
			return err
		}
		if cur.OrgIDs, err = tx.ModelGroupGrantOrgs(ctx, name); err != nil {
			return err
		}
		before, err := modelGroupToProto(cur)
		if err != nil {
			return err
		}
		after := proto.Clone(before).(*adminv1.ModelGroup)
		if err := applyMask(after, req.Msg.GetModelGroup(), req.Msg.GetUpdateMask(), "description", "platform_wide", routingMaskTop,
			"fallbacks", "resilience"); err != nil {
			return err
		}
		c := &validator{}
		validateDescription(c, after.GetDescription())
		validateRouting(c, routingMaskTop, after.GetRouting())
		validateFallbackList(c, "model_group.fallbacks", cur.Name, after.GetFallbacks())
		validateResilience(c, "model_group.resilience", after.GetResilience())
		if err := c.err(); err != nil {
			return err
		}
		// Clearing the platform-wide mark takes the group away from every
		// org without a grant: a revocation (security event).
		kind := events.ModelGroupUpserted
		if cur.PlatformWide && !after.GetPlatformWide() {
			kind = events.ModelGroupRevoked
		}
		cur.Description, cur.Routing, cur.PlatformWide = after.GetDescription(), routingJSON(after.GetRouting()), after.GetPlatformWide()
		if err := tx.ModelGroupUpdate(ctx, &cur); err != nil {
			return err
		}
		if !slices.Equal(after.GetFallbacks(), before.GetFallbacks()) || !proto.Equal(after.GetResilience(), before.GetResilience()) {
			if !slices.Equal(after.GetFallbacks(), before.GetFallbacks()) {
				if err := checkFallbackGraph(ctx, tx, func(string) string { return "model_group.fallbacks" }, map[string][]string{cur.Name: after.GetFallbacks()}); err != nil {
					return err
				}
			}
			if err := tx.ModelGroupResilienceSet(ctx, &cur, after.GetFallbacks(), resilienceJSON(after.GetResilience())); err != nil {
				return err
			}
		}
		if out, err = modelGroupToProto(cur); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionUpdated, objModelGroup, cur.Name, "", "", auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, kind, "", cur.Name, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateModelGroupResponse{ModelGroup: out}), nil
}

// DeleteModelGroup also fails with FailedPrecondition while another group
// lists it among its fallbacks (keys' and teams' overrides naming it are
// skipped by the data planes).
func (s *modelService) DeleteModelGroup(ctx context.Context, req *connect.Request[adminv1.DeleteModelGroupRequest]) (*connect.Response[adminv1.DeleteModelGroupResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.ModelGroupGetForUpdate(ctx, req.Msg.GetName())
		if err != nil {
			return err
		}
		if err := tx.FallbacksLock(ctx); err != nil {
			return err
		}
		refs, err := tx.ModelGroupFallbackReferrers(ctx, cur.Name)
		if err != nil {
			return err
		}
		if len(refs) > 0 {
			return &store.Error{Code: store.ErrFailedPrecondition, Msg: fmt.Sprintf(
				"model group %s is a fallback of %s; remove it from their fallbacks first", cur.Name, strings.Join(refs, ", "))}
		}
		before, err := modelGroupToProto(cur)
		if err != nil {
			return err
		}
		if err := tx.ModelGroupDelete(ctx, cur.Name); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionDeleted, objModelGroup, cur.Name, "", "", auditJSON(before), nil); err != nil {
			return err
		}
		return outbox(ctx, tx, events.ModelGroupDeleted, "", cur.Name, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteModelGroupResponse{}), nil
}

func (s *modelService) CreateDeployment(ctx context.Context, req *connect.Request[adminv1.CreateDeploymentRequest]) (*connect.Response[adminv1.CreateDeploymentResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	m := req.Msg
	want := &adminv1.Deployment{
		ModelGroup: m.GetModelGroup(), ApiBase: m.GetApiBase(), UpstreamModel: m.GetUpstreamModel(),
		Weight: m.GetWeight(), MaxConcurrency: m.GetMaxConcurrency(), Capabilities: m.GetCapabilities(),
		Tags: m.GetTags(), Prices: m.GetPrices(), Free: m.GetFree(),
	}
	if want.Weight == 0 {
		want.Weight = 1
	}
	c := &validator{}
	validModelGroupName(c, "model_group", want.GetModelGroup())
	validateDeployment(c, want)
	validateCredential(c, m.GetCredential())
	if err := c.err(); err != nil {
		return nil, err
	}
	ct, err := s.seal(m.GetCredential())
	if err != nil {
		return nil, err
	}
	d := store.Deployment{ID: ids.New(deploymentIDPrefix), ModelGroup: want.GetModelGroup(), CredentialCiphertext: ct}
	setDeploymentFields(&d, want)
	var out *adminv1.Deployment
	err = s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		if _, err := tx.ModelGroupGet(ctx, d.ModelGroup); err != nil {
			return err
		}
		if err := tx.DeploymentInsert(ctx, &d); err != nil {
			return err
		}
		out = deploymentToProto(d)
		if err := tx.Audit(ctx, audit.ActionCreated, objDeployment, d.ID, "", "", nil, auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.DeploymentUpserted, "", d.ID, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.CreateDeploymentResponse{Deployment: out}), nil
}

func (s *modelService) GetDeployment(ctx context.Context, req *connect.Request[adminv1.GetDeploymentRequest]) (*connect.Response[adminv1.GetDeploymentResponse], error) {
	if err := readShared(ctx, "deployments"); err != nil {
		return nil, err
	}
	d, err := s.store.DeploymentGet(ctx, req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	if err := s.deploymentVisible(ctx, d); err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.GetDeploymentResponse{Deployment: deploymentToProto(d)}), nil
}

func (s *modelService) ListDeployments(ctx context.Context, req *connect.Request[adminv1.ListDeploymentsRequest]) (*connect.Response[adminv1.ListDeploymentsResponse], error) {
	if err := readShared(ctx, "deployments"); err != nil {
		return nil, err
	}
	limit, after, err := pageArgs(req.Msg.GetPageSize(), req.Msg.GetPageToken())
	if err != nil {
		return nil, err
	}
	org := visibleOrg(ctx)
	if g := req.Msg.GetModelGroup(); g != "" {
		// A filter naming no group is a mistake worth saying, not an
		// empty list.
		mg, err := s.store.ModelGroupGet(ctx, g)
		if err != nil {
			return nil, err
		}
		if err := modelGroupVisible(ctx, mg); err != nil {
			return nil, err
		}
	}
	rows, err := s.store.DeploymentList(ctx, store.DeploymentQuery{ModelGroup: req.Msg.GetModelGroup()}, store.Page{After: after, Limit: limit})
	if err != nil {
		return nil, err
	}
	visible := map[string]bool{}
	if org != "" {
		// Deployments of groups the org was not granted are left out
		// (the page token still follows the unfiltered page).
		for _, d := range rows {
			if _, done := visible[d.ModelGroup]; done {
				continue
			}
			ok, err := s.store.ModelGroupVisibleTo(ctx, d.ModelGroup, org)
			if err != nil && !errors.Is(err, store.ErrNotFound) {
				return nil, err
			}
			visible[d.ModelGroup] = ok
		}
	}
	resp := &adminv1.ListDeploymentsResponse{}
	for _, d := range rows {
		if org != "" && !visible[d.ModelGroup] {
			continue
		}
		resp.Deployments = append(resp.Deployments, deploymentToProto(d))
	}
	if len(rows) > 0 {
		resp.NextPageToken = nextPageToken(len(rows), limit, rows[len(rows)-1].ID)
	}
	return connect.NewResponse(resp), nil
}

// splitCredentialPath removes "credential" from mask: it names the
// request's write-only credential field, not a Deployment field.
func splitCredentialPath(mask *fieldmaskpb.FieldMask) (*fieldmaskpb.FieldMask, bool) {
	rest := &fieldmaskpb.FieldMask{}
	found := false
	for _, p := range mask.GetPaths() {
		if p == "credential" {
			found = true
			continue
		}
		rest.Paths = append(rest.Paths, p)
	}
	return rest, found
}

func (s *modelService) UpdateDeployment(ctx context.Context, req *connect.Request[adminv1.UpdateDeploymentRequest]) (*connect.Response[adminv1.UpdateDeploymentResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	mask, setCred := splitCredentialPath(req.Msg.GetUpdateMask())
	cred := req.Msg.GetCredential()
	if cred != "" && !setCred {
		return nil, invalid("credential", `given, but "credential" is not in update_mask`)
	}
	var ct []byte
	if setCred {
		c := &validator{}
		validateCredential(c, cred)
		if err := c.err(); err != nil {
			return nil, err
		}
		var err error
		if ct, err = s.seal(cred); err != nil {
			return nil, err
		}
	}
	var out *adminv1.Deployment
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.DeploymentGetForUpdate(ctx, req.Msg.GetDeployment().GetId())
		if err != nil {
			return err
		}
		before := deploymentToProto(cur)
		after := proto.Clone(before).(*adminv1.Deployment)
		if len(mask.GetPaths()) > 0 || !setCred {
			if err := applyMask(after, req.Msg.GetDeployment(), mask, deploymentMaskPaths...); err != nil {
				return err
			}
		}
		if after.Weight == 0 {
			after.Weight = 1
		}
		c := &validator{}
		validateDeployment(c, after)
		if after.MaxConcurrency != before.MaxConcurrency {
			if err := checkDeploymentTraffic(c, cur.Traffic, after.MaxConcurrency); err != nil {
				return err
			}
		}
		if err := c.err(); err != nil {
			return err
		}
		setDeploymentFields(&cur, after)
		if setCred {
			cur.CredentialCiphertext = ct
		}
		if err := tx.DeploymentUpdate(ctx, &cur); err != nil {
			return err
		}
		out = deploymentToProto(cur)
		if err := tx.Audit(ctx, audit.ActionUpdated, objDeployment, cur.ID, "", "", auditJSON(before), auditJSON(out)); err != nil {
			return err
		}
		return outbox(ctx, tx, events.DeploymentUpserted, "", cur.ID, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.UpdateDeploymentResponse{Deployment: out}), nil
}

func (s *modelService) DeleteDeployment(ctx context.Context, req *connect.Request[adminv1.DeleteDeploymentRequest]) (*connect.Response[adminv1.DeleteDeploymentResponse], error) {
	if err := writeModels(ctx); err != nil {
		return nil, err
	}
	err := s.store.Mutate(ctx, actor(ctx), func(tx *store.Tx) error {
		cur, err := tx.DeploymentGetForUpdate(ctx, req.Msg.GetId())
		if err != nil {
			return err
		}
		if err := tx.DeploymentDelete(ctx, cur.ID); err != nil {
			return err
		}
		if err := tx.Audit(ctx, audit.ActionDeleted, objDeployment, cur.ID, "", "", auditJSON(deploymentToProto(cur)), nil); err != nil {
			return err
		}
		return outbox(ctx, tx, events.DeploymentDeleted, "", cur.ID, nil)
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&adminv1.DeleteDeploymentResponse{}), nil
}

// deploymentProtocols are the values of capabilities.protocols: the wire
// protocols a deployment may declare besides the OpenAI ones every
// deployment serves (docs/protocols.md).
var deploymentProtocols = []string{"anthropic_messages", "openai_responses"}

func validateProtocols(c *validator, ps []string) {
	seen := map[string]bool{}
	for i, p := range ps {
		f := fmt.Sprintf("capabilities.protocols[%d]", i)
		if !slices.Contains(deploymentProtocols, p) {
			c.add(f, "unknown protocol %q (one of %s)", p, strings.Join(deploymentProtocols, ", "))
		}
		if seen[p] {
			c.add(f, "duplicate protocol %q", p)
		}
		seen[p] = true
	}
}
