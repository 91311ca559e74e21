import torch, barqtrain
from triton.testing import do_bench
R,H=16384,4096
x=torch.randn(R,H,dtype=torch.bfloat16,device='cuda',requires_grad=True); w=torch.randn(H,dtype=torch.bfloat16,device='cuda',requires_grad=True)
dy=torch.randn_like(x)
src=torch.randn(1<<29//2*2, device='cuda', dtype=torch.bfloat16); dst=torch.empty_like(src)
t=do_bench(lambda: dst.copy_(src), return_mode='median'); print('copy TB/s', 2*src.numel()*2/t/1e9)
f=lambda: torch.ops.barqtrain.rms_norm_forward(x,w,1e-6,0.0,'llama')
y,rstd=f()
tf=do_bench(f, return_mode='median')
b=lambda: torch.ops.barqtrain.rms_norm_backward(dy,x,w,rstd,0.0,True)
tb=do_bench(b, return_mode='median')
n=R*H*2
print(f'fwd {tf*1e3:.1f}us {2*n/tf/1e9:.2f}TB/s  bwd {tb*1e3:.1f}us {3*n/tb/1e9:.2f}TB/s  total {5*n/(tf+tb)/1e9:.2f}TB/s')
def fb():
    y=barqtrain.ops.rms_norm(x,w); torch.autograd.grad(y,(x,w),dy)
t=do_bench(fb, return_mode='median'); print(f'autograd fwd+bwd {t*1e3:.1f}us {5*n/t/1e9:.2f}TB/s')
