package admin

import "github.com/sluicegw/sluice/proto/gen/sluice/admin/v1/adminv1connect"

// customerService implements CustomerService.
type customerService struct {
	*Server
	adminv1connect.UnimplementedCustomerServiceHandler
}
